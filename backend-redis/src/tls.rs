//! The TLS material of a deployment reached over TLS, and the clients built with it.
use fencelock_core::Error;
use redis::sentinel::SentinelClient;
use redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};

use crate::config::RedisConfig;
use crate::error::map_err;
use crate::topology::{Endpoint, RedisTls};

/// The TLS material of a deployment reached over TLS, read from [`RedisTls`]'s files at
/// connect time.
pub(crate) struct Tls {
    /// Trusted roots (`None`: the system's) and the client certificate, as PEM.
    #[cfg(feature = "tls")]
    pub(crate) certificates: redis::TlsCertificates,
}

impl Tls {
    /// Reads and checks the files of `settings` (see [`RedisTls`]).
    ///
    /// Every problem is an [`Error::InvalidConfig`] naming the file: the `redis` crate
    /// would report an unparsable file as a (retryable) I/O error, or an empty CA file
    /// as an unknown issuer on every connection.
    #[cfg(feature = "tls")]
    pub(crate) fn load(settings: &RedisTls) -> Result<Tls, Error> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let read = |path: &str| {
            std::fs::read(path).map_err(|e| {
                Error::InvalidConfig(format!("redis: cannot read TLS file {path}: {e}"))
            })
        };
        let invalid = |path: &str, what: &str, e: &dyn std::fmt::Display| {
            Error::InvalidConfig(format!("redis: TLS file {path}: {what}: {e}"))
        };
        let certificates = |path: &str| {
            let pem = read(path)?;
            let count = CertificateDer::pem_slice_iter(&pem)
                .try_fold(0_usize, |n, cert| cert.map(|_| n + 1))
                .map_err(|e| invalid(path, "not a PEM certificate file", &e))?;
            if count == 0 {
                return Err(Error::InvalidConfig(format!(
                    "redis: TLS file {path} holds no PEM certificate"
                )));
            }
            Ok(pem)
        };
        let root_cert = settings.ca.as_deref().map(certificates).transpose()?;
        let client_tls = match (&settings.cert, &settings.key) {
            (Some(cert), Some(key)) => {
                let client_cert = certificates(cert)?;
                let client_key = read(key)?;
                PrivateKeyDer::from_pem_slice(&client_key)
                    .map_err(|e| invalid(key, "no PEM private key", &e))?;
                Some(redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (None, None) => None,
            _ => {
                return Err(Error::InvalidConfig(
                    "redis: TLS `cert` and `key` go together".into(),
                ));
            }
        };
        Ok(Tls {
            certificates: redis::TlsCertificates {
                client_tls,
                root_cert,
            },
        })
    }

    /// Without the `tls` feature no TLS file can be used ([`open`](crate::connect::open) refuses every TLS
    /// scheme before this).
    #[cfg(not(feature = "tls"))]
    pub(crate) fn load(settings: &RedisTls) -> Result<Tls, Error> {
        if settings.is_empty() {
            Ok(Tls {})
        } else {
            Err(Error::InvalidConfig(
                "rediss:// needs the `tls` cargo feature of fencelock-redis".into(),
            ))
        }
    }
}

/// The address of `endpoint`, verified TLS when `tls` is given (the certificates are
/// added by the client or builder that uses it).
pub(crate) fn address(endpoint: &Endpoint, tls: Option<&Tls>) -> ConnectionAddr {
    match tls {
        Some(_) => ConnectionAddr::TcpTls {
            host: endpoint.host.clone(),
            port: endpoint.port,
            insecure: false,
            tls_params: None,
        },
        None => ConnectionAddr::Tcp(endpoint.host.clone(), endpoint.port),
    }
}

/// A Sentinel client that speaks TLS with `tls`' certificates both to the Sentinels and
/// to the master they name (with the Sentinels' and the master's own credentials).
#[cfg(feature = "tls")]
pub(crate) fn tls_sentinel_client(
    config: &RedisConfig,
    sentinels: &[Endpoint],
    service: &str,
    db: i64,
    tls: &Tls,
) -> Result<SentinelClient, Error> {
    use redis::TlsMode;
    use redis::sentinel::{SentinelClientBuilder, SentinelServerType};

    let mut builder = SentinelClientBuilder::new(
        sentinels.iter().map(|e| address(e, Some(tls))),
        service,
        SentinelServerType::Master,
    )
    .map_err(map_err)?
    .set_client_to_sentinel_certificates(tls.certificates.clone())
    .set_client_to_redis_tls_mode(TlsMode::Secure)
    .set_client_to_redis_certificates(tls.certificates.clone())
    .set_client_to_redis_db(db);
    if let Some(user) = &config.sentinel_username {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = &config.sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if let Some(user) = &config.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &config.password {
        builder = builder.set_client_to_redis_password(password);
    }
    builder.build().map_err(map_err)
}

/// Without the `tls` feature there is no TLS ([`open`](crate::connect::open) refuses it before this).
#[cfg(not(feature = "tls"))]
pub(crate) fn tls_sentinel_client(
    _config: &RedisConfig,
    _sentinels: &[Endpoint],
    _service: &str,
    _db: i64,
    _tls: &Tls,
) -> Result<SentinelClient, Error> {
    Err(Error::InvalidConfig(
        "rediss+sentinel:// needs the `tls` cargo feature of fencelock-redis".into(),
    ))
}

/// A client for one server, over TLS when `tls` is given.
pub(crate) fn client_with(
    endpoint: &Endpoint,
    tls: Option<&Tls>,
    info: RedisConnectionInfo,
) -> Result<Client, Error> {
    let conn_info = address(endpoint, tls)
        .into_connection_info()
        .map_err(map_err)?
        .set_redis_settings(info);
    #[cfg(feature = "tls")]
    if let Some(tls) = tls {
        return Client::build_with_tls(conn_info, tls.certificates.clone()).map_err(map_err);
    }
    Client::open(conn_info).map_err(map_err)
}
