//! Times the store's hot path (put, claim, read, ack) without Python, for profiling.
//! `cargo run --release --example hotpath -p asyncflow-core -- [row_bytes] [rows_per_put]`

use std::time::Instant;

use asyncflow_core::{ClaimSpec, DType, FieldSchema, NewRows, PutTarget, Store, StoreConfig, Wait};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("a number"));
    let size = args.next().unwrap_or(1024);
    let rows = args.next().unwrap_or(256);
    let rounds = (256 << 20) / (size * rows).max(1);
    let store = Store::new(StoreConfig::default()).unwrap();
    store.register_task("bench", None).unwrap();
    let payload = vec![7u8; size];
    let cells: Vec<(&[u8], u64)> = (0..rows).map(|_| (payload.as_slice(), size as u64)).collect();
    let target =
        PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], ..NewRows::default() });
    let spec = ClaimSpec {
        task: "bench".into(),
        fields: vec!["x".into()],
        batch_size: rows,
        ..ClaimSpec::default()
    };
    let (mut put, mut claim, mut read, mut ack) = (0.0, 0.0, 0.0, 0.0);
    for _ in 0..rounds {
        let t = Instant::now();
        let col = store
            .pack_column("x", FieldSchema::ragged(DType::U8, vec![]), &cells, Wait::timeout(None))
            .unwrap();
        store.put(vec![col], &target).unwrap();
        put += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let c = store.claim(&spec, false, Wait::timeout(None)).unwrap();
        claim += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let cols = store.read(&c.rows, &spec.fields).unwrap();
        read += t.elapsed().as_secs_f64();
        drop(cols);
        let t = Instant::now();
        store.ack(c.lease.unwrap(), None).unwrap();
        ack += t.elapsed().as_secs_f64();
    }
    let per = |s: f64| s / rounds as f64 * 1e6;
    println!(
        "{size} B x {rows} rows: put {:.1} us, claim {:.1} us, read {:.1} us, ack {:.1} us; {:.2} GB/s",
        per(put),
        per(claim),
        per(read),
        per(ack),
        (rounds * rows * size) as f64 / (put + claim + read + ack) / 1e9
    );
}
