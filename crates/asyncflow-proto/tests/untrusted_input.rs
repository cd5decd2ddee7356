//! No input makes the decoder panic: random bytes, mutations of valid frames, and every file of
//! the fuzzer's corpus (`fuzz/corpus/decode_frame`), replayed here so CI checks them with a plain
//! `cargo test`.

use std::path::Path;

use asyncflow_proto::untrusted::decode_everything;
use asyncflow_proto::{FrameHeader, Hello, Op, Request};
use proptest::prelude::*;

fn valid_frames() -> Vec<u8> {
    let hello = Request::Hello(Hello {
        token: Some("t".into()),
        host: "h".into(),
        leases: vec![7, 8],
        ring: 0,
        probe: false,
    });
    let mut out = Vec::new();
    for req in [hello, Request::Stats, Request::Clear { partition: "p".into() }] {
        let meta = req.encode();
        out.extend_from_slice(&FrameHeader::new(req.op(), 1, meta.len(), 0).encode());
        out.extend_from_slice(&meta);
    }
    out
}

#[test]
fn valid_frames_decode_as_frames() {
    assert_eq!(decode_everything(&valid_frames()), 3);
    assert!(Op::from_code(Op::Stats as u8).is_ok());
}

#[test]
fn every_corpus_input_decodes_without_panicking() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/decode_frame");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).expect("the fuzz corpus is checked in") {
        let path = entry.unwrap().path();
        decode_everything(&std::fs::read(&path).unwrap());
        replayed += 1;
    }
    assert!(replayed > 0, "the corpus at {} is empty", dir.display());
}

proptest! {
    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_everything(&data);
    }

    #[test]
    fn mutated_valid_frames_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut data = valid_frames();
        let len = data.len();
        for (at, byte) in flips {
            data[at % len] = byte;
        }
        decode_everything(&data);
    }
}
