//! Throwaway certificates for TLS tests, made with the `openssl` command-line tool.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::binaries::require_program;
use crate::scratch::Scratch;

/// A private CA, a server certificate for `127.0.0.1` and `localhost` (SAN `IP:127.0.0.1`,
/// `DNS:localhost`) and a client certificate (`CN=fencelock test client`), all signed by
/// the CA, valid for two days, with ECDSA P-256 keys, as PEM files in a temporary
/// directory (removed when dropped).
///
/// Panics if `openssl` is not installed (Debian package `openssl`) or fails.
///
/// ```no_run
/// let certs = fencelock_testkit::TestCertificates::generate();
/// println!("trust {}", certs.ca().display());
/// ```
pub struct TestCertificates {
    dir: Scratch,
}

impl TestCertificates {
    /// Makes a new CA and the server and client certificates it signs.
    pub fn generate() -> Self {
        Self::make("/CN=localhost", "IP:127.0.0.1,DNS:localhost")
    }

    /// Like [`TestCertificates::generate`], but the server certificate is valid only for
    /// the names in `subject_alt_names` (openssl's `subjectAltName` syntax, e.g.
    /// `"DNS:elsewhere.test"` or `"DNS:localhost"`), and its subject is
    /// `CN=fencelock test server`. For tests of a client connecting by a name the
    /// certificate does not list: the CA is trusted, only the name is wrong.
    pub fn generate_for(subject_alt_names: &str) -> Self {
        Self::make("/CN=fencelock test server", subject_alt_names)
    }

    /// A new CA, a server certificate with `server_subject` and `server_names` as its
    /// subject alternative names, and the client certificate.
    fn make(server_subject: &str, server_names: &str) -> Self {
        let dir =
            Scratch::new("fencelock-certs-").unwrap_or_else(|e| panic!("fencelock-testkit: {e}"));
        let certs = TestCertificates { dir };
        certs.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=fencelock test CA",
        ]);
        certs.sign(
            "server",
            server_subject,
            &format!("subjectAltName={server_names}\nextendedKeyUsage=serverAuth\n"),
        );
        certs.sign(
            "client",
            "/CN=fencelock test client",
            "extendedKeyUsage=clientAuth\n",
        );
        certs
    }

    /// Makes `NAME-key.pem` and `NAME.pem`, signed by the CA, with the extensions `ext`.
    fn sign(&self, name: &str, subject: &str, ext: &str) {
        let key = format!("{name}-key.pem");
        let csr = format!("{name}.csr");
        let ext_file = format!("{name}.ext");
        let cert = format!("{name}.pem");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ]);
        std::fs::write(self.dir.path().join(&ext_file), ext)
            .expect("fencelock-testkit: cannot write a certificate extension file");
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext_file,
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let program = require_program("openssl", "openssl");
        let output = Command::new(&program)
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .unwrap_or_else(|e| panic!("fencelock-testkit: cannot run openssl: {e}"));
        assert!(
            output.status.success(),
            "fencelock-testkit: openssl {args:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate (`ca.pem`): what clients trust.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server certificate (`server.pem`), for `127.0.0.1` and `localhost` (for the
    /// names given to [`TestCertificates::generate_for`], if made by it).
    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server's private key (`server-key.pem`).
    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server-key.pem")
    }

    /// The client certificate (`client.pem`), for mutual TLS.
    pub fn client_cert(&self) -> PathBuf {
        self.dir.path().join("client.pem")
    }

    /// The client's private key (`client-key.pem`).
    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client-key.pem")
    }
}
