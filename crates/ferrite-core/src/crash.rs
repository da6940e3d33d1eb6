//! Crash reports. A panic while a batch runs fails that batch's requests and is counted (the
//! batcher catches it); a fatal signal inside ONNX Runtime (SIGSEGV, SIGBUS, SIGILL, SIGFPE,
//! SIGABRT) cannot be survived. Before the process dies, a handler writes
//! `<dir>/ferrite-crash-<pid>.txt`: the time, Ferrite's and ONNX Runtime's versions, the signal,
//! what the faulting thread was running (model, version, its worker thread, and the batch's input
//! names, datatypes and shapes, never the data), and the native backtrace. Then the handler that was
//! there before runs: in Python, `faulthandler`, whose dump of every Python thread's stack (the
//! thread holding the GIL marked "Current thread") goes to the same file; else the default action.
//!
//! What a worker runs is written, before each batch, into a fixed buffer of its thread, so the
//! handler only reads memory and calls async-signal-safe functions (`open`, `write`, `dup2`,
//! `backtrace_symbols_fd`, `sigaction`, `raise`; `backtrace` is primed at install so that it does
//! not load libgcc inside the handler).

use std::{
    cell::{Cell, UnsafeCell},
    ffi::CString,
    path::{Path, PathBuf},
    sync::atomic::{AtomicPtr, Ordering},
};

/// The signals a report is written for.
const SIGNALS: [libc::c_int; 5] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGABRT];
const RUNNING_BYTES: usize = 4096;

struct Running {
    len: Cell<usize>,
    buf: UnsafeCell<[u8; RUNNING_BYTES]>,
}

thread_local! {
    static RUNNING: Running = const { Running { len: Cell::new(0), buf: UnsafeCell::new([0; RUNNING_BYTES]) } };
}

struct Installed {
    path: CString,
    header: Vec<u8>,
    previous: [libc::sigaction; SIGNALS.len()],
}

static INSTALLED: AtomicPtr<Installed> = AtomicPtr::new(std::ptr::null_mut());

/// The report file of this process in `dir`.
pub fn report_path(dir: &Path) -> PathBuf {
    dir.join(format!("ferrite-crash-{}.txt", std::process::id()))
}

/// Crash reports left in `dir` by earlier processes (to be said at start-up).
pub fn earlier_reports(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("ferrite-crash-") && n.ends_with(".txt"))
        })
        .filter(|p| *p != report_path(dir))
        .collect();
    found.sort();
    found
}

/// Installs the handler, writing reports into `dir` (created if missing); returns the report's
/// path. Installing again moves the reports to the new `dir`. `runtime` names the inference
/// runtime loaded (its version), for the report's header.
pub fn install(dir: &Path, runtime: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("crash directory {}: {e}", dir.display()))?;
    let dir = dir.canonicalize().map_err(|e| format!("crash directory {}: {e}", dir.display()))?;
    let path = report_path(&dir);
    let header = format!(
        "Ferrite crash report\nferrite {}\nonnxruntime {}\npid {}\n",
        crate::wire::VERSION,
        runtime,
        std::process::id()
    );
    let c_path =
        CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "a NUL in the crash path".to_string())?;
    // SAFETY: zeroed sigaction structs are valid; `handler` has the SA_SIGINFO signature; the
    // previous actions are kept for chaining. Priming `backtrace` loads what it needs now.
    unsafe {
        let mut frames = [std::ptr::null_mut::<libc::c_void>(); 2];
        libc::backtrace(frames.as_mut_ptr(), frames.len() as libc::c_int);
        let old = INSTALLED.load(Ordering::Acquire);
        let mut previous: [libc::sigaction; SIGNALS.len()] = std::mem::zeroed();
        for (i, &sig) in SIGNALS.iter().enumerate() {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(sig, &action, &mut previous[i]) != 0 {
                return Err(format!("cannot install the crash handler for signal {sig}"));
            }
            // Reinstalled: chain to what was there before the first install, not to ourselves.
            if !old.is_null() {
                previous[i] = (*old).previous[i];
            }
        }
        let installed = Box::into_raw(Box::new(Installed { path: c_path, header: header.into_bytes(), previous }));
        // The old one stays allocated: a handler running on another thread may still read it.
        INSTALLED.store(installed, Ordering::Release);
    }
    Ok(path)
}

/// Whether reports are being written (what `running` records is then kept).
pub fn installed() -> bool {
    !INSTALLED.load(Ordering::Acquire).is_null()
}

/// Records what this thread is about to run (see the module); `describe` writes it.
pub fn running(describe: impl FnOnce(&mut dyn std::fmt::Write)) {
    if !installed() {
        return;
    }
    RUNNING.with(|r| {
        // SAFETY: only this thread writes its buffer; the handler reads it on this thread, after
        // `len` says how much is written.
        let buf = unsafe { &mut *r.buf.get() };
        r.len.set(0);
        let mut w = SliceWriter { buf, len: 0 };
        describe(&mut w);
        r.len.set(w.len);
    });
}

/// This thread runs nothing any more.
pub fn idle() {
    RUNNING.with(|r| r.len.set(0));
}

struct SliceWriter<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl std::fmt::Write for SliceWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

fn write_all(fd: libc::c_int, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for its length.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

fn write_number(fd: libc::c_int, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    write_all(fd, &digits[i..]);
}

fn signal_name(sig: libc::c_int) -> &'static [u8] {
    match sig {
        libc::SIGSEGV => b"SIGSEGV",
        libc::SIGBUS => b"SIGBUS",
        libc::SIGILL => b"SIGILL",
        libc::SIGFPE => b"SIGFPE",
        libc::SIGABRT => b"SIGABRT",
        _ => b"?",
    }
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let installed = INSTALLED.load(Ordering::Acquire);
    if installed.is_null() {
        return;
    }
    // SAFETY: `installed` is never freed (see `install`); everything below is async-signal-safe.
    let c = unsafe { &*installed };
    let fd =
        unsafe { libc::open(c.path.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC, 0o600) };
    if fd >= 0 {
        write_all(fd, &c.header);
        write_all(fd, b"signal ");
        write_number(fd, sig as u64);
        write_all(fd, b" (");
        write_all(fd, signal_name(sig));
        write_all(fd, b")\ntime ");
        // SAFETY: time(NULL) is async-signal-safe.
        write_number(fd, unsafe { libc::time(std::ptr::null_mut()) }.max(0) as u64);
        write_all(fd, b" (unix seconds)\nthread id ");
        // SAFETY: gettid is async-signal-safe.
        write_number(fd, unsafe { libc::syscall(libc::SYS_gettid) }.max(0) as u64);
        write_all(fd, b"\n\nrunning on the faulting thread:\n");
        let running = RUNNING.try_with(|r| {
            // SAFETY: written by this very thread before the fault; `len` bounds what is read.
            let buf = unsafe { &*r.buf.get() };
            write_all(fd, &buf[..r.len.get().min(RUNNING_BYTES)]);
            r.len.get() > 0
        });
        if running != Ok(true) {
            write_all(fd, b"no batch (the fault is not on a model's worker thread, or between batches)\n");
        }
        write_all(fd, b"\nnative backtrace:\n");
        let mut frames = [std::ptr::null_mut::<libc::c_void>(); 64];
        // SAFETY: primed at install; writes at most `frames.len()` entries.
        unsafe {
            let n = libc::backtrace(frames.as_mut_ptr(), frames.len() as libc::c_int);
            libc::backtrace_symbols_fd(frames.as_ptr(), n, fd);
        }
        write_all(fd, b"\n");
        // What the previous handler prints to stderr (Python's faulthandler: every thread's
        // stack) goes on in the report.
        unsafe {
            libc::dup2(fd, 2);
            libc::close(fd);
        }
    }
    let index = SIGNALS.iter().position(|&s| s == sig).unwrap_or(0);
    let previous = c.previous[index];
    // SAFETY: chaining to the handler that was installed before, with its own calling convention,
    // or ending with the default action.
    unsafe {
        let p = previous.sa_sigaction;
        if p != libc::SIG_DFL && p != libc::SIG_IGN {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(p);
                f(sig, info, context);
            } else {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(p);
                f(sig);
            }
        }
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &default, std::ptr::null_mut());
        libc::raise(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_runs_is_recorded_within_its_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let path = install(dir.path(), "test").unwrap();
        assert!(path.ends_with(format!("ferrite-crash-{}.txt", std::process::id())));
        running(|w| {
            let _ = write!(w, "model m version 1\n{}", "x".repeat(2 * RUNNING_BYTES));
        });
        RUNNING.with(|r| assert_eq!(r.len.get(), RUNNING_BYTES));
        idle();
        RUNNING.with(|r| assert_eq!(r.len.get(), 0));
        std::fs::write(dir.path().join("ferrite-crash-1.txt"), "old").unwrap();
        std::fs::write(&path, "this process's own").unwrap();
        let names: Vec<_> =
            earlier_reports(path.parent().unwrap()).iter().map(|p| p.file_name().unwrap().to_owned()).collect();
        assert_eq!(names, ["ferrite-crash-1.txt"]);
    }
}
