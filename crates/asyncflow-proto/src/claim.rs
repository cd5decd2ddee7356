//! A claim's options as tagged fields, so options can be added without a new protocol version:
//! each option is `(tag, length, value)`. A receiver skips unknown tags marked optional and
//! refuses unknown required ones (an option it would silently ignore could change the result).

use asyncflow_core::scheduler::CostModel;
use asyncflow_core::{ClaimSpec, Share};

use crate::error::ProtoError;
use crate::wire::{Reader, Writer};

/// Set on tags a receiver may ignore if it does not know them.
pub const OPTIONAL: u16 = 0x8000;

const TASK: u16 = 1;
const FIELDS: u16 = 2;
const BATCH_SIZE: u16 = 3;
const PARTITION: u16 = 4;
const MIN_VERSION: u16 = 5;
const WHOLE_GROUPS: u16 = 6;
const SHARE: u16 = 7;
const PARTIAL_AFTER: u16 = 8;

const COST_TOKENS: u8 = 0;
const COST_ATTENTION: u8 = 1;

fn encode_share(w: &mut Writer, share: &Share) {
    w.u64(share.step).u64(share.replica);
    w.u32(share.dp_rank).u32(share.dp_size).u32(share.replica_rank).u32(share.replica_size);
    w.opt(share.balance_field.as_deref(), |w, f| {
        w.str(f);
    });
    match share.cost {
        CostModel::Tokens => w.u8(COST_TOKENS),
        CostModel::Attention { linear_weight } => w.u8(COST_ATTENTION).u64(linear_weight.to_bits()),
    };
    w.bool(share.equal_count);
}

fn decode_share(r: &mut Reader<'_>) -> Result<Share, ProtoError> {
    let (step, replica) = (r.u64()?, r.u64()?);
    let (dp_rank, dp_size, replica_rank, replica_size) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let balance_field = r.opt(Reader::string)?;
    let cost = match r.u8()? {
        COST_TOKENS => CostModel::Tokens,
        COST_ATTENTION => CostModel::Attention { linear_weight: f64::from_bits(r.u64()?) },
        c => return Err(ProtoError::malformed(format!("unknown cost model {c}"))),
    };
    let equal_count = r.bool()?;
    Ok(Share {
        step,
        replica,
        dp_rank,
        dp_size,
        replica_rank,
        replica_size,
        balance_field,
        cost,
        equal_count,
    })
}

pub fn encode(w: &mut Writer, spec: &ClaimSpec) {
    // The count comes first and is known last: written in its place once the options are.
    let count_at = w.buf.len();
    w.u16(0);
    let mut count = 0u16;
    let mut add = |tag, value: &dyn Fn(&mut Writer)| {
        w.u16(tag).sized(value);
        count += 1;
    };
    add(TASK, &|w| {
        w.str(&spec.task);
    });
    add(FIELDS, &|w| {
        w.strs(&spec.fields);
    });
    add(BATCH_SIZE, &|w| {
        w.u64(spec.batch_size as u64);
    });
    if let Some(p) = &spec.partition {
        add(PARTITION, &|w| {
            w.str(p);
        });
    }
    if let Some(v) = spec.min_version {
        add(MIN_VERSION, &|w| {
            w.u64(v);
        });
    }
    if spec.whole_groups {
        add(WHOLE_GROUPS, &|w| {
            w.bool(true);
        });
    }
    if let Some(share) = &spec.share {
        add(SHARE, &|w| encode_share(w, share));
    }
    if let Some(after) = spec.partial_after {
        add(PARTIAL_AFTER, &|w| {
            w.duration(after);
        });
    }
    w.buf[count_at..count_at + 2].copy_from_slice(&count.to_le_bytes());
}

pub fn decode(r: &mut Reader<'_>) -> Result<ClaimSpec, ProtoError> {
    let count = r.u16()?;
    let (mut task, mut fields, mut batch_size) = (None, None, None);
    let (mut partition, mut min_version, mut whole_groups) = (None, None, false);
    let (mut share, mut partial_after) = (None, None);
    for _ in 0..count {
        let tag = r.u16()?;
        let mut value = Reader::new(r.bytes()?);
        match tag {
            TASK => task = Some(value.string()?),
            FIELDS => fields = Some(value.strings()?),
            BATCH_SIZE => {
                batch_size = Some(
                    usize::try_from(value.u64()?)
                        .map_err(|_| ProtoError::malformed("batch size out of range"))?,
                );
            }
            PARTITION => partition = Some(value.string()?),
            MIN_VERSION => min_version = Some(value.u64()?),
            WHOLE_GROUPS => whole_groups = value.bool()?,
            SHARE => share = Some(decode_share(&mut value)?),
            PARTIAL_AFTER => partial_after = Some(value.duration()?),
            t if t & OPTIONAL != 0 => continue,
            t => return Err(ProtoError::malformed(format!("unsupported claim option tag {t}"))),
        }
        value.finish()?;
    }
    let missing = |what: &str| ProtoError::malformed(format!("claim without {what}"));
    Ok(ClaimSpec {
        task: task.ok_or_else(|| missing("a task"))?,
        fields: fields.ok_or_else(|| missing("fields"))?,
        batch_size: batch_size.ok_or_else(|| missing("a batch size"))?,
        partition,
        min_version,
        whole_groups,
        share,
        partial_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spec() -> ClaimSpec {
        ClaimSpec {
            task: "train".into(),
            fields: vec!["ids".into(), "adv".into()],
            batch_size: 64,
            partition: Some("step-3".into()),
            min_version: Some(2),
            whole_groups: true,
            share: Some(Share {
                step: 7,
                replica: 1,
                dp_rank: 2,
                dp_size: 4,
                replica_rank: 1,
                replica_size: 2,
                balance_field: Some("ids".into()),
                cost: CostModel::Attention { linear_weight: 768.0 },
                equal_count: true,
            }),
            partial_after: Some(Duration::from_millis(250)),
        }
    }

    fn round_trip(bytes: &[u8]) -> Result<ClaimSpec, ProtoError> {
        let mut r = Reader::new(bytes);
        let out = decode(&mut r)?;
        r.finish()?;
        Ok(out)
    }

    #[test]
    fn every_option_round_trips() {
        let mut w = Writer::new();
        encode(&mut w, &spec());
        let back = round_trip(&w.buf).unwrap();
        assert_eq!(format!("{back:?}"), format!("{:?}", spec()));
    }

    #[test]
    fn unknown_optional_options_are_skipped_and_unknown_required_ones_refused() {
        let mut base = Writer::new();
        encode(&mut base, &spec());
        let count = u16::from_le_bytes([base.buf[0], base.buf[1]]);
        for (tag, accepted) in [(OPTIONAL | 0x63, true), (0x63, false)] {
            let mut w = Writer::new();
            w.u16(count + 1);
            w.buf.extend_from_slice(&base.buf[2..]);
            w.u16(tag).sized(|w| {
                w.u64(5);
            });
            assert_eq!(round_trip(&w.buf).is_ok(), accepted, "tag {tag:#x}");
        }
    }
}
