//! Shared by the Curator interop tests: compiling a Java driver against Debian's Curator
//! jars (`libcurator-recipes-java`) with `javac`, and running one driven line by line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use tokio::sync::mpsc;

/// The jars a Curator driver needs, in `/usr/share/java`.
pub const JARS: &[&str] = &[
    "curator-recipes.jar",
    "curator-framework.jar",
    "curator-client.jar",
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// How long any single step of a driven participant may take.
pub const STEP: Duration = Duration::from_secs(30);

/// Compiles `tests/java/{class}.java` into `dir`; returns the class path to run it with.
pub fn compile(dir: &Path, class: &str) -> String {
    let mut classpath: Vec<String> = JARS
        .iter()
        .map(|jar| {
            let path = Path::new("/usr/share/java").join(jar);
            assert!(
                path.is_file(),
                "{} is missing: install the Debian package libcurator-recipes-java (./scripts/test does)",
                path.display()
            );
            path.display().to_string()
        })
        .collect();
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/java")
        .join(format!("{class}.java"));
    let status = Command::new("javac")
        .args(["-nowarn", "-encoding", "UTF-8", "-d"])
        .arg(dir)
        .arg("-cp")
        .arg(classpath.join(":"))
        .arg(&source)
        .status()
        .expect("javac (Debian package default-jdk-headless)");
    assert!(status.success(), "javac failed");
    classpath.insert(0, dir.display().to_string());
    classpath.join(":")
}

/// A Java participant driven one command per line on stdin, answering one line each;
/// killed when dropped.
pub struct Curator {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Curator {
    /// Starts `class` with `args` and waits for its `READY` line.
    pub async fn start(classpath: &str, class: &str, args: &[&str]) -> Curator {
        let mut child = Command::new("java")
            .args(["-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", classpath])
            .arg(class)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("java");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        let mut curator = Curator {
            child,
            stdin,
            lines,
        };
        assert_eq!(curator.line().await, "READY");
        curator
    }

    /// Sends one command.
    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("write to java");
        self.stdin.flush().expect("flush to java");
    }

    /// The next line the participant prints (within [`STEP`]).
    pub async fn line(&mut self) -> String {
        tokio::time::timeout(STEP, self.lines.recv())
            .await
            .expect("the Curator participant answers")
            .expect("the Curator participant exited early")
    }

    /// Sends `command` and returns its answer.
    pub async fn ask(&mut self, command: &str) -> String {
        self.send(command);
        self.line().await
    }

    /// Whether a line is waiting (without waiting for one).
    pub fn try_line(&mut self) -> Option<String> {
        self.lines.try_recv().ok()
    }
}

impl Drop for Curator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
