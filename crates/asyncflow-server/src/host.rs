//! Which machine this process runs on: shared memory is only offered between processes that
//! see the same kernel boot, and only works if the client can also reach the daemon's socket.

use std::sync::OnceLock;

/// The kernel's boot id (unique per machine and boot), or the host name where it is missing.
pub fn host_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .or_else(|_| std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_owned()))
            .unwrap_or_default()
    })
}
