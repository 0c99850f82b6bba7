//! Calls of the Lua scripts: a script's text and SHA1, and one call with its keys and
//! arguments, sent as `EVALSHA` or, on `NOSCRIPT`, as `EVAL` (see [`crate::scripts`]).

use std::time::Duration;

use redis::{Cmd, RedisWrite, Script, ToRedisArgs};

/// `d` in whole milliseconds, as the scripts take durations (saturating).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A Lua script: its text and its SHA1.
pub(crate) struct Lua {
    code: String,
    hash: String,
}

impl Lua {
    pub(crate) fn new(code: &str) -> Lua {
        Lua {
            hash: Script::new(code).get_hash().to_owned(),
            code: code.to_owned(),
        }
    }

    /// A call of this script, to be given its keys and arguments.
    pub(crate) fn prepare_invoke(&'static self) -> Call {
        Call {
            lua: self,
            // A lock's three keys carry its name three times (the release's arguments
            // once or twice more): no buffer grows for names up to 70 bytes or so;
            // longer ones cost a reallocation, nothing else.
            keys: Parts::with_capacity(4, 512),
            args: Parts::with_capacity(8, 256),
        }
    }
}

/// One call of a [`Lua`] script with its keys and arguments, sendable as `EVALSHA` or
/// `EVAL` (see the [`scripts`](crate::scripts) module documentation).
pub(crate) struct Call {
    lua: &'static Lua,
    keys: Parts,
    args: Parts,
}

/// Encoded arguments back to back in one buffer: a call costs a few allocations, not
/// one per argument (the client's CPU per lock showed them).
struct Parts {
    data: Vec<u8>,
    /// Where each argument ends in `data`.
    ends: Vec<usize>,
}

impl Parts {
    /// Room for `count` arguments of `bytes` in all before the buffers grow (growing
    /// them showed in the client's CPU per lock).
    fn with_capacity(count: usize, bytes: usize) -> Parts {
        Parts {
            data: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(count),
        }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let part = &self.data[start..end];
            start = end;
            part
        })
    }
}

impl RedisWrite for Parts {
    fn write_arg(&mut self, arg: &[u8]) {
        self.data.extend_from_slice(arg);
        self.ends.push(self.data.len());
    }

    fn writer_for_next_arg(&mut self) -> impl std::io::Write + '_ {
        PartWriter(self)
    }
}

/// Writes one argument into [`Parts`]; it ends when the writer is dropped.
struct PartWriter<'a>(&'a mut Parts);

impl std::io::Write for PartWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.data.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for PartWriter<'_> {
    fn drop(&mut self) {
        self.0.ends.push(self.0.data.len());
    }
}

impl Call {
    /// Appends a key (`KEYS[n]`).
    pub(crate) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Call {
        key.write_redis_args(&mut self.keys);
        self
    }

    /// Appends an argument (`ARGV[n]`).
    pub(crate) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Call {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// `EVALSHA sha1 numkeys keys... args...`.
    pub(crate) fn evalsha(&self) -> Cmd {
        self.command("EVALSHA", &self.lua.hash)
    }

    /// `EVAL script numkeys keys... args...`.
    pub(crate) fn eval(&self) -> Cmd {
        self.command("EVAL", &self.lua.code)
    }

    fn command(&self, verb: &str, script: &str) -> Cmd {
        let mut cmd = Cmd::with_capacity(
            3 + self.keys.len() + self.args.len(),
            verb.len() + script.len() + 4 + self.keys.data.len() + self.args.data.len(),
        );
        cmd.arg(verb).arg(script).arg(self.keys.len());
        for part in self.keys.iter().chain(self.args.iter()) {
            cmd.arg(part);
        }
        cmd
    }
}
