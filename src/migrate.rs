//! `migrate://` URLs: the [migration layer](fencelock_core::layer::migration) configured
//! by URL.
//!
//! ```text
//! migrate://?legacy=<leg URL>&target=<leg URL>&phase=legacy|legacy-first|target-first|target
//!           [&epoch=1][&legacy_epoch=0][&second_leg_wait=2s][&require=...]
//! ```
//!
//! The leg URLs are percent-encoded (`&`, `?`, `=` and `%` at least) and may carry their
//! own `require=`. A leg the phase does not take may be left out, and is neither checked
//! against a server nor connected. `epoch` is the epoch of target-era tokens (default 1),
//! `legacy_epoch` that of legacy-era tokens (default 0: the legacy backend's own tokens).

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::layer::migration::MAX_EPOCH;
use fencelock_core::parse_duration;
use fencelock_core::{DistributedLock, Error, MigrationLock, MigrationPhase};
use percent_encoding::percent_decode_str;

use crate::Config;
use crate::redact::redact_url;

/// The URL scheme of the migration layer.
pub(crate) const SCHEME: &str = "migrate";

/// A parsed `migrate://` URL.
#[derive(Debug)]
pub(crate) struct MigrationSpec {
    phase: MigrationPhase,
    legacy: Option<Config>,
    target: Option<Config>,
    legacy_epoch: u8,
    epoch: u8,
    second_leg_wait: Option<Duration>,
}

impl MigrationSpec {
    /// Parses and checks a `migrate://` URL (without the facade's own options).
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::InvalidUrl {
            url: redact_url(url),
            reason,
        };
        let rest = url.split_once("://").map_or("", |(_, rest)| rest);
        let (head, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !matches!(head, "" | "/") {
            return Err(bad(
                "migrate:// takes no host or path, only ?legacy=...&target=...&phase=...".into(),
            ));
        }
        let mut phase = None;
        let (mut legacy, mut target) = (None, None);
        let (mut legacy_epoch, mut epoch) = (0u8, None);
        let mut second_leg_wait = None;
        let mut seen: Vec<&str> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&key) {
                return Err(bad(format!("`{key}` is given twice; give it once")));
            }
            seen.push(key);
            let value = percent_decode_str(value)
                .decode_utf8()
                .map_err(|_| bad(format!("`{key}` is not valid percent-encoded UTF-8")))?;
            let epoch_value = || {
                value
                    .parse::<u8>()
                    .ok()
                    .filter(|e| *e <= MAX_EPOCH)
                    .ok_or_else(|| {
                        Error::InvalidConfig(format!(
                            "migration: `{key}` must be a number from 0 to {MAX_EPOCH}"
                        ))
                    })
            };
            match key {
                "phase" => phase = Some(value.parse::<MigrationPhase>()?),
                "legacy" => legacy = Some(leg("legacy", &value)?),
                "target" => target = Some(leg("target", &value)?),
                "epoch" => epoch = Some(epoch_value()?),
                "legacy_epoch" => legacy_epoch = epoch_value()?,
                "second_leg_wait" => {
                    second_leg_wait = Some(parse_duration(&value).map_err(|reason| {
                        Error::InvalidConfig(format!("migration: second_leg_wait: {reason}"))
                    })?)
                }
                other => {
                    return Err(bad(format!(
                        "unknown migrate:// option `{other}` (known: legacy, target, phase, \
                         epoch, legacy_epoch, second_leg_wait, require); percent-encode the \
                         leg URLs so their own options stay inside them"
                    )));
                }
            }
        }
        let phase = phase
            .ok_or_else(|| bad("missing phase=legacy|legacy-first|target-first|target".into()))?;
        let epoch = epoch.unwrap_or(legacy_epoch.saturating_add(1));
        if epoch <= legacy_epoch || epoch > MAX_EPOCH {
            return Err(Error::InvalidConfig(format!(
                "migration: epoch ({epoch}) must be larger than legacy_epoch ({legacy_epoch}) \
                 and at most {MAX_EPOCH}"
            )));
        }
        for (needed, present, which) in [
            (phase.uses_legacy(), legacy.is_some(), "legacy"),
            (phase.uses_target(), target.is_some(), "target"),
        ] {
            if needed && !present {
                return Err(bad(format!("phase {phase} needs {which}=<URL>")));
            }
        }
        Ok(MigrationSpec {
            phase,
            legacy,
            target,
            legacy_epoch,
            epoch,
            second_leg_wait,
        })
    }
}

fn leg(which: &str, url: &str) -> Result<Config, Error> {
    let scheme = url
        .trim()
        .split_once("://")
        .map_or("", |(scheme, _)| scheme);
    if scheme.eq_ignore_ascii_case(SCHEME) {
        return Err(Error::InvalidConfig(format!(
            "migration: the {which} leg cannot itself be a migration; for a second \
             migration use the previous target as legacy, with legacy_epoch set to the \
             previous epoch"
        )));
    }
    Config::from_url(url)
}

/// Builds a `migrate://` URL for `phase` from the legacy and target backends' URLs,
/// percent-encoding them as query values. Further settings (`epoch`, `legacy_epoch`,
/// `second_leg_wait`, `require`, ...) can be appended as `&key=value`.
///
/// # Examples
///
/// ```
/// use fencelock::{MigrationPhase, migration_url};
///
/// let url = migration_url(
///     MigrationPhase::LegacyFirst,
///     "redis://10.0.0.5:6379?layout=raw&prefix=lock:",
///     "etcd://10.0.0.9:2379/locks",
/// );
/// assert_eq!(
///     url,
///     "migrate://?phase=legacy-first\
///      &legacy=redis%3A%2F%2F10.0.0.5%3A6379%3Flayout%3Draw%26prefix%3Dlock%3A\
///      &target=etcd%3A%2F%2F10.0.0.9%3A2379%2Flocks"
/// );
/// ```
pub fn migration_url(phase: MigrationPhase, legacy: &str, target: &str) -> String {
    let enc = |url: &str| {
        percent_encoding::utf8_percent_encode(url, crate::redact::COMPONENT).to_string()
    };
    format!(
        "migrate://?phase={phase}&legacy={}&target={}",
        enc(legacy),
        enc(target)
    )
}

/// Connects the legs the phase takes and builds the migration lock.
pub(crate) async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, Error> {
    let spec = MigrationSpec::parse(url)?;
    let legacy = match (&spec.legacy, spec.phase.uses_legacy()) {
        (Some(config), true) => Some(crate::connect_config(config).await?),
        _ => None,
    };
    let target = match (&spec.target, spec.phase.uses_target()) {
        (Some(config), true) => Some(crate::connect_config(config).await?),
        _ => None,
    };
    let mut lock = MigrationLock::new(spec.phase, legacy, target)?
        .with_epochs(spec.legacy_epoch, spec.epoch)?;
    if let Some(wait) = spec.second_leg_wait {
        lock = lock.with_second_leg_wait(wait)?;
    }
    Ok(Arc::new(lock))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> Result<MigrationSpec, String> {
        MigrationSpec::parse(url).map_err(|e| match e {
            Error::InvalidUrl { .. } => "invalid-url".into(),
            Error::InvalidConfig(_) => "invalid-config".into(),
            other => format!("{other:?}"),
        })
    }

    #[test]
    fn url_table() {
        let spec = parsed(
            "migrate://?legacy=redis%3A%2F%2Fh%3A1%3Flayout%3Draw%26prefix%3Dlock%3A\
             &target=etcd%3A%2F%2Fh%3A2%2Flocks&phase=legacy-first&second_leg_wait=500ms",
        )
        .unwrap();
        assert_eq!(spec.phase, MigrationPhase::LegacyFirst);
        assert_eq!((spec.legacy_epoch, spec.epoch), (0, 1));
        assert_eq!(
            spec.legacy.unwrap().backend_url(),
            "redis://h:1?layout=raw&prefix=lock:"
        );
        assert_eq!(spec.second_leg_wait, Some(Duration::from_millis(500)));
        let spec = parsed("migrate:///?target=mem://&phase=target&legacy_epoch=1").unwrap();
        assert_eq!((spec.legacy_epoch, spec.epoch), (1, 2));
        assert!(spec.legacy.is_none());
        // Unencoded `+` survives in a leg's scheme.
        let spec = parsed("migrate://?legacy=redis+sentinel://s:1/m&phase=legacy").unwrap();
        assert_eq!(spec.legacy.unwrap().scheme(), "redis+sentinel");

        for (url, expected) in [
            ("migrate://?legacy=mem://&target=mem://", "invalid-url"),
            ("migrate://host?legacy=mem://&phase=legacy", "invalid-url"),
            ("migrate://?phase=legacy-first&legacy=mem://", "invalid-url"),
            ("migrate://?phase=target&legacy=mem://", "invalid-url"),
            ("migrate://?phase=sideways&target=mem://", "invalid-config"),
            (
                "migrate://?phase=target&target=mem://&epoch=0",
                "invalid-config",
            ),
            (
                "migrate://?phase=target&target=mem://&epoch=128",
                "invalid-config",
            ),
            (
                "migrate://?phase=target&target=mem://&epoch=2&legacy_epoch=2",
                "invalid-config",
            ),
            (
                "migrate://?phase=target&target=mem://&second_leg_wait=soon",
                "invalid-config",
            ),
            (
                "migrate://?phase=target&target=mem://?a=1&b=2",
                "invalid-url",
            ),
            ("migrate://?phase=target&target=nourl", "invalid-url"),
            (
                "migrate://?phase=target&target=migrate%3A%2F%2F%3Fphase%3Dtarget",
                "invalid-config",
            ),
        ] {
            assert_eq!(
                parsed(url).map(|_| "ok".to_owned()),
                Err(expected.into()),
                "{url}"
            );
        }
    }

    #[test]
    fn leg_passwords_stay_hidden() {
        let url = "migrate://?phase=legacy&legacy=redis%3A%2F%2F%3Ahunter2%40h%3A1&nope=1";
        let err = MigrationSpec::parse(url).unwrap_err();
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
        let config = Config::from_url(url.trim_end_matches("&nope=1")).unwrap();
        assert!(!format!("{config} {config:?}").contains("hunter2"));
    }
}
