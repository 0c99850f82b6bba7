//! Locating the installed server programs; a missing one is a test failure.

use std::path::{Path, PathBuf};

/// The packages `./scripts/test` installs.
const INSTALL_HINT: &str = "run ./scripts/test, which installs the test servers \
     (apt-get install etcd-server etcd-client zookeeper libslf4j-java redis-server \
     redis-tools protobuf-compiler libprotobuf-dev default-jdk-headless \
     libcurator-recipes-java openssl iproute2 iptables); backend tests fail rather than skip \
     when a server is missing";

/// The full path of `program` found on `PATH` (or in /usr/bin, /usr/sbin), or a panic
/// naming the Debian `package` that provides it.
pub(crate) fn require_program(program: &str, package: &str) -> PathBuf {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path_var)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
        .unwrap_or_else(|| {
            panic!(
                "fencelock-testkit: `{program}` not found on PATH (Debian package `{package}`); \
                 {INSTALL_HINT}"
            )
        })
}

/// `path` itself, or a panic naming the Debian `package` that provides it.
pub(crate) fn require_file(path: &str, package: &str) -> PathBuf {
    let path = PathBuf::from(path);
    assert!(
        path.is_file(),
        "fencelock-testkit: {} not found (Debian package `{package}`); {INSTALL_HINT}",
        path.display()
    );
    path
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "Debian package `some-package`); run ./scripts/test")]
    fn a_missing_program_is_a_failure_naming_its_package() {
        require_program("fencelock-no-such-server", "some-package");
    }

    #[test]
    #[should_panic(expected = "Debian package `zookeeper`")]
    fn a_missing_file_is_a_failure_naming_its_package() {
        require_file("/nonexistent/zookeeper.jar", "zookeeper");
    }

    #[test]
    fn installed_programs_are_found() {
        assert!(require_program("sh", "dash").is_absolute());
    }
}
