//! TLS for `etcds://`.

use etcd_client::ConnectOptions;
use fencelock_core::Error;

use crate::config::EtcdTls;

/// Adds the TLS settings to the connect options.
#[cfg(feature = "tls")]
pub(crate) fn apply(
    options: ConnectOptions,
    tls: Option<&EtcdTls>,
) -> Result<ConnectOptions, Error> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let Some(tls) = tls else { return Ok(options) };
    let read = |path: &str| {
        std::fs::read(path)
            .map_err(|e| Error::InvalidConfig(format!("etcd: cannot read TLS file {path}: {e}")))
    };
    let mut settings = TlsOptions::new();
    settings = match &tls.ca {
        Some(ca) => settings.ca_certificate(Certificate::from_pem(read(ca)?)),
        // No CA given: the system's roots, as a browser or curl would.
        None => settings.with_native_roots(),
    };
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            settings = settings.identity(Identity::from_pem(read(cert)?, read(key)?))
        }
        (None, None) => {}
        _ => {
            return Err(Error::InvalidConfig(
                "etcd: TLS `cert` and `key` go together".into(),
            ));
        }
    }
    if let Some(domain) = &tls.domain {
        settings = settings.domain_name(domain.clone());
    }
    Ok(options.with_tls(settings))
}

/// Without the `tls` feature, `etcds://` is refused with a clear error.
#[cfg(not(feature = "tls"))]
pub(crate) fn apply(
    options: ConnectOptions,
    tls: Option<&EtcdTls>,
) -> Result<ConnectOptions, Error> {
    match tls {
        None => Ok(options),
        Some(_) => Err(Error::InvalidConfig(
            "etcds:// needs TLS support: enable fencelock's `etcd-tls` feature (fencelock-etcd's `tls`)".into(),
        )),
    }
}
