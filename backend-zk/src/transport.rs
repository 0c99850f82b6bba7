//! What a session needs besides the settings: the TLS material and the SASL
//! credentials, read and checked once per client, before any connection is made.
//!
//! TLS goes through `zookeeper-client`'s own rustls support (`tls` feature). That crate
//! builds its rustls configuration with the process-wide default crypto provider, so this
//! module installs rustls' `ring` provider as that default when no provider is installed
//! yet (an application that installs its own first keeps it).
//!
//! `zookeeper-client` reports a failed TLS handshake only as a lost connection. When a
//! TLS connect fails, [`Transport::diagnose`] makes one handshake of its own with the same
//! certificates to name the cause (an untrusted server certificate, a client certificate
//! the server requires, a server that does not speak TLS).

use std::fmt;
use std::time::Duration;

use fencelock_core::Error;
use tokio::time::Instant;
use zookeeper_client as zk;

#[cfg(feature = "tls")]
use crate::config::ZkTls;
use crate::config::{AuthMethod, ZkConfig};
use crate::error::{BACKEND, map};

/// The TLS and SASL material of one client (see the module documentation).
#[derive(Clone)]
pub(crate) struct Transport {
    #[cfg(feature = "tls")]
    tls: Option<Tls>,
    #[cfg(feature = "sasl")]
    sasl: Option<zk::SaslOptions>,
}

/// TLS options for `zookeeper-client` and, for [`Transport::diagnose`], the same
/// certificates as a rustls configuration.
#[cfg(feature = "tls")]
#[derive(Clone)]
struct Tls {
    options: zk::TlsOptions,
    probe: std::sync::Arc<rustls::ClientConfig>,
    /// Whether a client certificate is configured (`cert=`, `key=`).
    identity: bool,
}

impl fmt::Debug for Transport {
    /// Says only what is configured: never a key or a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Transport");
        #[cfg(feature = "tls")]
        debug.field("tls", &self.tls.is_some());
        #[cfg(feature = "sasl")]
        debug.field("sasl", &self.sasl.is_some());
        debug.finish_non_exhaustive()
    }
}

impl Transport {
    /// Reads and checks the TLS files and prepares the SASL credentials of `config`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a missing, unreadable or unusable TLS file, a host
    /// that cannot be a TLS server name, or TLS / SASL without the cargo feature.
    pub(crate) fn prepare(config: &ZkConfig) -> Result<Self, Error> {
        #[cfg(not(feature = "tls"))]
        if config.tls().is_some() {
            return Err(Error::InvalidConfig(
                "zks:// needs TLS support: cargo feature `zookeeper-tls` of fencelock (`tls` of \
                 fencelock-zk)"
                    .into(),
            ));
        }
        let sasl = match (config.auth_method(), config.auth()) {
            (AuthMethod::SaslDigestMd5, Some(auth)) => Some(auth),
            _ => None,
        };
        #[cfg(not(feature = "sasl"))]
        if sasl.is_some() {
            return Err(Error::InvalidConfig(
                "sasl=digest-md5 needs SASL support: cargo feature `zookeeper-sasl` of fencelock \
                 (`sasl` of fencelock-zk)"
                    .into(),
            ));
        }
        Ok(Transport {
            #[cfg(feature = "tls")]
            tls: config
                .tls()
                .map(|tls| Tls::load(tls, config.hosts()))
                .transpose()?,
            #[cfg(feature = "sasl")]
            sasl: sasl.map(|auth| {
                zk::SaslOptions::digest_md5(auth.user.clone(), auth.password.clone()).into()
            }),
        })
    }

    /// Adds the TLS and SASL options to `connector`.
    pub(crate) fn apply(&self, connector: zk::Connector) -> zk::Connector {
        #[cfg(feature = "tls")]
        let connector = match &self.tls {
            Some(tls) => connector.with_tls(tls.options.clone()),
            None => connector,
        };
        #[cfg(feature = "sasl")]
        let connector = match &self.sasl {
            Some(sasl) => connector.with_sasl(sasl.clone()),
            None => connector,
        };
        connector
    }

    /// Connects `connector` to `hosts`, over TLS if configured.
    pub(crate) async fn connect(
        &self,
        connector: zk::Connector,
        hosts: &str,
    ) -> Result<zk::Client, zk::Error> {
        let connector = self.apply(connector);
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            return connector.secure_connect(hosts).await;
        }
        connector.connect(hosts).await
    }

    /// The error for a connect to `config`'s hosts, started at `started`, that failed
    /// with `err`: over TLS, the handshake's own failure when there is one
    /// (`zookeeper-client` reports it as a lost connection), found within what is left of
    /// the connect timeout (at least half a second).
    pub(crate) async fn connect_failed(
        &self,
        config: &ZkConfig,
        started: Instant,
        err: zk::Error,
    ) -> Error {
        let tls = config.tls().is_some();
        if tls
            && matches!(
                err,
                zk::Error::NoHosts | zk::Error::ConnectionLoss | zk::Error::Custom(_)
            )
        {
            let budget = config
                .connect_timeout()
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(500));
            if let Some(cause) = self.diagnose(config.hosts(), budget).await {
                return cause;
            }
        }
        match err {
            zk::Error::NoHosts => Error::unavailable(
                BACKEND,
                format!(
                    "no ZooKeeper server at {} accepted a session (each refused or closed the \
                     connection){}",
                    config.hosts(),
                    if tls {
                        ""
                    } else {
                        "; a TLS port (secureClientPort) needs zks://"
                    }
                ),
            ),
            zk::Error::AuthFailed => Error::backend(
                BACKEND,
                false,
                format!(
                    "ZooKeeper refused the session: authentication failed ({})",
                    match (config.auth(), config.auth_method()) {
                        (None, _) => "no credentials given, and the server requires them",
                        (Some(_), AuthMethod::SaslDigestMd5) => {
                            "SASL DIGEST-MD5: wrong user or password"
                        }
                        (Some(_), _) => {
                            "addauth digest credentials; a server that requires SASL needs \
                             sasl=digest-md5"
                        }
                    }
                ),
            ),
            other => map(other),
        }
    }

    /// After a TLS connect to `hosts` failed: the cause of a TLS handshake failure with the
    /// first host, found with a handshake of our own within `budget`, as a
    /// non-retryable [`Error::Backend`]; `None` if the handshake works (or there is no
    /// TLS), so the failure was something else.
    pub(crate) async fn diagnose(&self, hosts: &str, budget: Duration) -> Option<Error> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.diagnose(hosts, budget).await;
        }
        let _ = (hosts, budget);
        None
    }
}

#[cfg(feature = "tls")]
impl Tls {
    /// Reads and checks the files of `settings` for connections to `hosts`.
    fn load(settings: &ZkTls, hosts: &str) -> Result<Tls, Error> {
        use rustls::RootCertStore;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        // zookeeper-client builds its rustls configuration with the process default
        // provider; with more than one provider compiled in, rustls cannot pick one.
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Err: another thread installed one just now, which is as good.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        for host in hosts.split(',') {
            let bare = bare_host(host);
            ServerName::try_from(bare).map_err(|e| {
                Error::InvalidConfig(format!(
                    "zookeeper: `{bare}` cannot be checked against a TLS certificate: {e}"
                ))
            })?;
        }
        let read = |path: &str| {
            std::fs::read(path).map_err(|e| {
                Error::InvalidConfig(format!("zookeeper: cannot read TLS file {path}: {e}"))
            })
        };
        let invalid = |path: &str, what: &str, e: &dyn fmt::Display| {
            Error::InvalidConfig(format!("zookeeper: TLS file {path}: {what}: {e}"))
        };
        let certificates = |path: &str| -> Result<(String, Vec<CertificateDer<'static>>), Error> {
            let pem = read(path)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(path, "not a PEM certificate file", &e))?;
            if certs.is_empty() {
                return Err(Error::InvalidConfig(format!(
                    "zookeeper: TLS file {path} holds no PEM certificate"
                )));
            }
            let text = String::from_utf8(pem)
                .map_err(|e| invalid(path, "not a PEM certificate file", &e))?;
            Ok((text, certs))
        };

        let (ca_pem, roots) = match &settings.ca {
            Some(path) => {
                let (pem, certs) = certificates(path)?;
                let mut roots = RootCertStore::empty();
                for cert in certs {
                    roots
                        .add(cert)
                        .map_err(|e| invalid(path, "not a CA certificate", &e))?;
                }
                (pem, roots)
            }
            None => system_roots()?,
        };
        let mut options = zk::TlsOptions::new()
            .with_pem_ca(&ca_pem)
            .map_err(|e| Error::InvalidConfig(format!("zookeeper: TLS CA certificates: {e}")))?;
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::InvalidConfig(format!("zookeeper: TLS: {e}")))?
            .with_root_certificates(roots);
        let probe = match (&settings.cert, &settings.key) {
            (Some(cert), Some(key)) => {
                let (cert_pem, chain) = certificates(cert)?;
                let key_pem = read(key)?;
                let private_key = PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| invalid(key, "no PEM private key", &e))?;
                let key_text = String::from_utf8(key_pem)
                    .map_err(|e| invalid(key, "no PEM private key", &e))?;
                let config = builder
                    .with_client_auth_cert(chain, private_key)
                    .map_err(|e| invalid(key, "not the key of the certificate", &e))?;
                options = options
                    .with_pem_identity(&cert_pem, &key_text)
                    .map_err(|e| invalid(key, "unusable client certificate or key", &e))?;
                config
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(Error::InvalidConfig(
                    "zookeeper: TLS `cert` and `key` go together".into(),
                ));
            }
        };
        Ok(Tls {
            options,
            probe: std::sync::Arc::new(probe),
            identity: settings.cert.is_some(),
        })
    }

    /// See [`Transport::diagnose`].
    async fn diagnose(&self, hosts: &str, budget: Duration) -> Option<Error> {
        use rustls::pki_types::ServerName;
        use tokio::io::AsyncReadExt;

        let host = hosts.split(',').next()?;
        let (name, port) = host.rsplit_once(':')?;
        let bare = bare_host(name).to_owned();
        let port: u16 = port.parse().ok()?;
        let server_name = ServerName::try_from(bare.clone()).ok()?;
        let connector = tokio_rustls::TlsConnector::from(self.probe.clone());
        // An alert from the server refuses us; anything else is our verdict on the server.
        let refused = |e: std::io::Error| {
            let text = e.to_string();
            if text.contains("alert") {
                format!(
                    "TLS handshake with {host} failed: the server refused {} ({text})",
                    if self.identity {
                        "the client certificate"
                    } else {
                        "a client without a certificate: give one with cert= and key="
                    }
                )
            } else if text.contains("eof") || text.contains("corrupt") {
                format!(
                    "TLS handshake with {host} failed: {text} (the server does not speak TLS \
                     there: is it the plain clientPort rather than the secureClientPort?)"
                )
            } else {
                format!("TLS handshake with {host} failed: {text}")
            }
        };
        let attempt = async {
            let tcp = tokio::net::TcpStream::connect((bare.as_str(), port))
                .await
                .ok()?;
            let mut stream = match connector.connect(server_name, tcp).await {
                Ok(stream) => stream,
                Err(e) => return Some(refused(e)),
            };
            // TLS 1.3: a server that refuses the client's certificate (or its absence)
            // may say so only after the handshake, in an alert: read it (a server that
            // waits for a request says nothing).
            let mut byte = [0_u8; 1];
            match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await {
                Ok(Err(e)) => Some(refused(e)),
                _ => None,
            }
        };
        let cause = tokio::time::timeout(budget, attempt).await.ok()??;
        Some(Error::backend(BACKEND, false, cause))
    }
}

/// A host without the brackets of an IPv6 address.
#[cfg(feature = "tls")]
fn bare_host(host: &str) -> &str {
    let host = match host.rsplit_once(':') {
        Some((name, port)) if !port.contains(']') && port.parse::<u16>().is_ok() => name,
        _ => host,
    };
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The system's root certificates, as PEM for `zookeeper-client` and as a rustls store.
#[cfg(feature = "tls")]
fn system_roots() -> Result<(String, rustls::RootCertStore), Error> {
    let loaded = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let mut pem = String::new();
    for cert in loaded.certs {
        if roots.add(cert.clone()).is_ok() {
            pem.push_str("-----BEGIN CERTIFICATE-----\n");
            for line in base64(cert.as_ref()).as_bytes().chunks(64) {
                pem.push_str(std::str::from_utf8(line).unwrap_or_default());
                pem.push('\n');
            }
            pem.push_str("-----END CERTIFICATE-----\n");
        }
    }
    if roots.is_empty() {
        let reasons: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
        return Err(Error::InvalidConfig(format!(
            "zookeeper: no system root certificates found ({}); give the CA with ca=PATH",
            if reasons.is_empty() {
                "none installed".to_owned()
            } else {
                reasons.join("; ")
            }
        )));
    }
    Ok((pem, roots))
}

/// Standard base64 with padding (for PEM).
#[cfg(feature = "tls")]
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected, "{input}");
        }
    }

    #[test]
    fn bare_hosts_lose_port_and_brackets() {
        assert_eq!(bare_host("zk1:2281"), "zk1");
        assert_eq!(bare_host("[::1]:2281"), "::1");
        assert_eq!(bare_host("127.0.0.1:1"), "127.0.0.1");
        assert_eq!(bare_host("[::1]"), "::1");
    }
}

#[cfg(test)]
mod feature_tests {
    use super::*;

    /// TLS and SASL without their cargo features are configuration errors naming the
    /// feature; with them, files are still checked before any connection.
    #[test]
    fn tls_and_sasl_need_their_features() {
        let tls = ZkConfig::from_url("zks://127.0.0.1:1?ca=/no/such/ca.pem").unwrap();
        match Transport::prepare(&tls) {
            Err(Error::InvalidConfig(m)) if cfg!(feature = "tls") => {
                assert!(m.contains("cannot read TLS file"), "{m}")
            }
            Err(Error::InvalidConfig(m)) => assert!(m.contains("zookeeper-tls"), "{m}"),
            other => panic!("{other:?}"),
        }
        let sasl = ZkConfig::from_url("zk://u:hunter2@127.0.0.1:1?sasl=digest-md5").unwrap();
        match Transport::prepare(&sasl) {
            Ok(transport) if cfg!(feature = "sasl") => {
                assert!(!format!("{transport:?}").contains("hunter2"))
            }
            Err(Error::InvalidConfig(m)) if !cfg!(feature = "sasl") => {
                assert!(m.contains("zookeeper-sasl"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
}
