//! Feeds arbitrary bytes to every decoder a peer can reach; any panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    asyncflow_proto::untrusted::decode_everything(data);
});
