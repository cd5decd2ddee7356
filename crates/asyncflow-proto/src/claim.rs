//! A claim's options as tagged fields, so options can be added without a new protocol version:
//! each option is `(tag, length, value)`. A receiver skips unknown tags marked optional and
//! refuses unknown required ones (an option it would silently ignore could change the result).

use asyncflow_core::ClaimSpec;

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

fn tagged(w: &mut Writer, tag: u16, value: impl FnOnce(&mut Writer)) {
    let mut inner = Writer::new();
    value(&mut inner);
    w.u16(tag).bytes(&inner.buf);
}

pub fn encode(w: &mut Writer, spec: &ClaimSpec) {
    let mut fields = Writer::new();
    let mut count = 0u16;
    let mut add = |tag, value: &dyn Fn(&mut Writer)| {
        tagged(&mut fields, tag, value);
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
    w.u16(count);
    w.buf.extend_from_slice(&fields.buf);
}

pub fn decode(r: &mut Reader<'_>) -> Result<ClaimSpec, ProtoError> {
    let count = r.u16()?;
    let (mut task, mut fields, mut batch_size) = (None, None, None);
    let (mut partition, mut min_version, mut whole_groups) = (None, None, false);
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ClaimSpec {
        ClaimSpec {
            task: "train".into(),
            fields: vec!["ids".into(), "adv".into()],
            batch_size: 64,
            partition: Some("step-3".into()),
            min_version: Some(2),
            whole_groups: true,
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
            tagged(&mut w, tag, |w| {
                w.u64(5);
            });
            assert_eq!(round_trip(&w.buf).is_ok(), accepted, "tag {tag:#x}");
        }
    }
}
