//! This process's id without a system call on every request: read once, and read again in the
//! child of a fork. libc runs `pthread_atfork` handlers in the child of every `fork()` (Python's
//! `os.fork` and `multiprocessing` go through it); a child made by a bare `clone` system call
//! that then used a connection would not be noticed.

use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};

/// The id last read, or 0 when it is to be read again.
static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget_in_child() {
    PID.store(0, Ordering::Relaxed);
}

/// The id of the calling process (`std::process::id()`).
pub fn process_id() -> u32 {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: the handler only stores to an atomic, which is safe in a forked child.
        unsafe { libc::pthread_atfork(None, None, Some(forget_in_child)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

#[cfg(test)]
mod tests {
    use super::process_id;

    #[test]
    fn a_forked_child_reads_its_own_id() {
        let parent = process_id();
        assert_eq!(parent, std::process::id());
        let mut fds = [0; 2];
        // SAFETY: a plain pipe; the child only reads ids, writes one byte and exits.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            match libc::fork() {
                0 => {
                    let seen = process_id();
                    let ok = u8::from(seen == std::process::id() && seen != parent);
                    libc::write(fds[1], (&raw const ok).cast(), 1);
                    libc::_exit(0);
                }
                child => {
                    assert!(child > 0);
                    let mut byte = 0u8;
                    assert_eq!(libc::read(fds[0], (&raw mut byte).cast(), 1), 1);
                    libc::waitpid(child, std::ptr::null_mut(), 0);
                    libc::close(fds[0]);
                    libc::close(fds[1]);
                    assert_eq!(byte, 1, "the child saw its parent's id");
                }
            }
        }
        assert_eq!(process_id(), parent);
    }
}
