//! A child process owned by the harness: signalled by PID, killed when dropped.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

pub use nix::sys::signal::Signal;
use nix::{sys::signal::kill, unistd::Pid};

/// How often a wait polls the child.
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Start `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> std::io::Result<Proc> {
        let out = File::options().create(true).append(true).open(log)?;
        cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
        let child = cmd.spawn()?;
        Ok(Proc { name: name.to_owned(), child, log: log.to_owned(), exited: None })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits i32"));
        let _ = kill(pid, signal); // already gone is fine
    }

    /// Whether the process is still running (a stopped process counts as running).
    pub fn is_running(&mut self) -> bool {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited.is_none()
    }

    /// Wait for the process to exit, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while self.is_running() && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        self.exited
    }

    /// `kill -9`: the process dies without any chance to clean up.
    pub fn kill9(&mut self) {
        self.signal(Signal::SIGKILL);
        self.wait_exit(Duration::from_secs(10));
    }

    /// `SIGSTOP`: the process freezes mid-whatever (a GC pause, a stalled VM).
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// `SIGCONT`: it carries on as if nothing happened.
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// `SIGTERM`, then wait up to `timeout` for it to exit.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.signal(Signal::SIGTERM);
        self.wait_exit(timeout)
    }

    /// The last `lines` lines of the process's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.is_running() {
            self.resume(); // a stopped process must be able to die
            self.kill9();
        }
    }
}

/// Whether a process is stopped (SIGSTOP: state `T` in `/proc/<pid>/stat`).
pub fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat.rfind(')').and_then(|end| stat.get(end + 2..end + 3)) == Some("T")
}

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat`; `None`
/// if it is gone. Benchmarks divide the difference over a run by the work done.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = Stat::read(pid)?;
    ticks_to_duration(stat.utime + stat.stime)
}

/// CPU time of a process and its children, live or exited: its own, what its exited
/// children used (counted once it has reaped them), and what its live children used so
/// far. For a server that works in child processes (a Postgres server: the postmaster and
/// one backend per connection); grandchildren count only once their parent reaped them.
pub fn cpu_time_with_children(pid: u32) -> Option<Duration> {
    let stat = Stat::read(pid)?;
    let mut ticks = stat.utime + stat.stime + stat.cutime + stat.cstime;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(child) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        // A child gone since the listing counts in `cutime` at the next reading.
        if let Some(child) = Stat::read(child).filter(|c| c.ppid == pid) {
            ticks += child.utime + child.stime;
        }
    }
    ticks_to_duration(ticks)
}

/// The parent of a process (`None` if it is gone).
pub fn parent_pid(pid: u32) -> Option<u32> {
    Stat::read(pid).map(|s| s.ppid)
}

/// The fields of `/proc/<pid>/stat` the CPU accounting reads (in clock ticks).
struct Stat {
    ppid: u32,
    utime: u64,
    stime: u64,
    cutime: u64,
    cstime: u64,
}

impl Stat {
    fn read(pid: u32) -> Option<Stat> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name (field 2) may hold spaces: count fields after its closing ')'.
        // Field n of the file (n ≥ 3) is then the (n - 3)th: ppid is 4, utime 14, stime
        // 15, cutime 16, cstime 17.
        let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
        let field = |n: usize| fields.get(n - 3)?.parse().ok();
        Some(Stat {
            ppid: u32::try_from(field(4)?).ok()?,
            utime: field(14)?,
            stime: field(15)?,
            cutime: field(16)?,
            cstime: field(17)?,
        })
    }
}

fn ticks_to_duration(ticks: u64) -> Option<Duration> {
    let per_second = u64::try_from(nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??).ok()?;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / per_second))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_process_is_seen_stopped() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(!is_stopped(pid));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGSTOP).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !is_stopped(pid) {
            assert!(Instant::now() < deadline, "never seen stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn cpu_time_grows_with_work_done() {
        /// Generous: spinning this long on a loaded machine still gets some CPU.
        const SPIN_WITHIN: Duration = Duration::from_secs(60);
        let pid = std::process::id();
        let before = cpu_time(pid).expect("our own stat");
        // Work until the counter shows 100 ms of CPU (no CPU share of wall time is
        // assumed: the machine may be shared), then check sleeping adds next to nothing.
        let started = Instant::now();
        let mut x = 0u64;
        while cpu_time(pid).unwrap() - before < Duration::from_millis(100) {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            assert!(started.elapsed() < SPIN_WITHIN, "spinning never showed as CPU time");
        }
        let worked = cpu_time(pid).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let slept = cpu_time(pid).unwrap() - worked;
        assert!(slept < Duration::from_millis(100), "300 ms asleep counted {slept:?} of CPU");
        assert!(cpu_time(u32::MAX).is_none(), "no such process");
    }

    #[test]
    fn a_parents_count_includes_its_childrens_work() {
        /// Generous: the child spinning this long on a loaded machine still gets some CPU.
        const SPIN_WITHIN: Duration = Duration::from_secs(60);
        // A shell that starts one spinning child and waits; the shell itself sleeps.
        let mut parent = Proc::spawn(
            "spinner",
            {
                let mut cmd = Command::new("sh");
                cmd.args(["-c", "sh -c 'while :; do :; done' & wait"]);
                cmd
            },
            &std::env::temp_dir().join(format!("lh-cpu-children-{}.log", std::process::id())),
        )
        .unwrap();
        let pid = parent.pid();
        // The spinning child, by its PID (the one whose parent is the shell), killed when
        // this test ends however it ends (declared after the shell: dropped first).
        let started = Instant::now();
        let child = loop {
            let found = std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .find(|c| Stat::read(*c).is_some_and(|s| s.ppid == pid));
            if let Some(child) = found {
                break KillOnDrop(child);
            }
            assert!(started.elapsed() < SPIN_WITHIN, "the shell never started its child");
            std::thread::sleep(Duration::from_millis(10));
        };
        while cpu_time_with_children(pid).unwrap() < Duration::from_millis(200) {
            assert!(started.elapsed() < SPIN_WITHIN, "the child's spinning never showed");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(cpu_time(pid).unwrap() < Duration::from_millis(100), "the shell itself waits");
        assert_eq!(parent_pid(pid), Some(std::process::id()));
        assert_eq!(parent_pid(child.0), Some(pid));
        drop(child);
        parent.kill9();
    }

    /// Kills a process that no [`Proc`] owns (a grandchild) by its PID when dropped.
    struct KillOnDrop(u32);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0 as i32), Signal::SIGKILL);
        }
    }
}
