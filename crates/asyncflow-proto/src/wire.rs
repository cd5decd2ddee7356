//! Little-endian primitives every message is built from. The reader checks every length against
//! the bytes actually present before allocating, so a lying length prefix costs nothing.

use std::time::Duration;

use asyncflow_core::{DType, FieldSchema};

use crate::error::ProtoError;

/// Appends encoded values to a byte vector.
#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer whose first `bytes` need no reallocation (a message's usual size).
    pub fn with_capacity(bytes: usize) -> Self {
        Self { buf: Vec::with_capacity(bytes) }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(u32::try_from(v.len()).expect("a field longer than 4 GiB"));
        self.buf.extend_from_slice(v);
        self
    }

    /// What `put` writes, as [`Writer::bytes`] would write it, written in place: its length is
    /// filled in after it.
    pub fn sized(&mut self, put: impl FnOnce(&mut Self)) -> &mut Self {
        let at = self.buf.len();
        self.u32(0);
        put(self);
        let len = u32::try_from(self.buf.len() - at - 4).expect("a field longer than 4 GiB");
        self.buf[at..at + 4].copy_from_slice(&len.to_le_bytes());
        self
    }

    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    pub fn opt<T>(&mut self, v: Option<T>, put: impl FnOnce(&mut Self, T)) -> &mut Self {
        match v {
            None => self.u8(0),
            Some(x) => {
                self.u8(1);
                put(self, x);
                self
            }
        }
    }

    pub fn list<T>(&mut self, items: &[T], mut put: impl FnMut(&mut Self, &T)) -> &mut Self {
        self.u32(u32::try_from(items.len()).expect("a list longer than 4G items"));
        for item in items {
            put(self, item);
        }
        self
    }

    pub fn u64s(&mut self, v: &[u64]) -> &mut Self {
        self.list(v, |w, &x| {
            w.u64(x);
        })
    }

    /// A number in as few bytes as it needs: seven bits a byte, the lowest first, the top bit
    /// set on every byte but the last (LEB128). For numbers a message carries many of, mostly
    /// small: fewer bytes to copy between processes.
    pub fn varint(&mut self, mut v: u64) -> &mut Self {
        while v >= 0x80 {
            self.buf.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.u8(v as u8)
    }

    /// A counted list of [`Writer::varint`]s.
    pub fn varints(&mut self, v: &[u64]) -> &mut Self {
        self.list(v, |w, &x| {
            w.varint(x);
        })
    }

    pub fn strs(&mut self, v: &[String]) -> &mut Self {
        self.list(v, |w, s| {
            w.str(s);
        })
    }

    /// A duration as whole microseconds.
    pub fn duration(&mut self, v: Duration) -> &mut Self {
        self.u64(u64::try_from(v.as_micros()).unwrap_or(u64::MAX))
    }

    pub fn schema(&mut self, s: &FieldSchema) -> &mut Self {
        self.u8(s.dtype as u8);
        self.opt(s.trailing.as_deref(), |w, t| {
            w.u64s(t);
        })
    }
}

/// Reads encoded values off a byte slice, failing (never panicking) on short or bad input.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, at: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Fails unless every byte was consumed: trailing garbage is an error, not padding.
    pub fn finish(&self) -> Result<(), ProtoError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(ProtoError::malformed(format!("{n} unexpected trailing bytes"))),
        }
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.remaining() < n {
            return Err(ProtoError::Truncated { needed: n - self.remaining() });
        }
        let out = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        Ok(self.take(N)?.try_into().expect("took exactly N bytes"))
    }

    pub fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn bool(&mut self) -> Result<bool, ProtoError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(ProtoError::malformed(format!("boolean byte {b}"))),
        }
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], ProtoError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    pub fn string(&mut self) -> Result<String, ProtoError> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| ProtoError::malformed("string is not UTF-8"))
    }

    pub fn opt<T>(
        &mut self,
        get: impl FnOnce(&mut Self) -> Result<T, ProtoError>,
    ) -> Result<Option<T>, ProtoError> {
        match self.u8()? {
            0 => Ok(None),
            1 => get(self).map(Some),
            b => Err(ProtoError::malformed(format!("option tag {b}"))),
        }
    }

    /// A counted list whose items take at least `min_item` bytes each; the count is checked
    /// against the bytes left before anything is allocated.
    pub fn list<T>(
        &mut self,
        min_item: usize,
        mut get: impl FnMut(&mut Self) -> Result<T, ProtoError>,
    ) -> Result<Vec<T>, ProtoError> {
        let n = self.u32()? as usize;
        let needed = n.saturating_mul(min_item.max(1));
        if needed > self.remaining() {
            return Err(ProtoError::Truncated { needed: needed - self.remaining() });
        }
        // Filled in place: collecting the results through `Result` would know no size, and
        // grow the vector by reallocating as it went.
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(get(self)?);
        }
        Ok(items)
    }

    pub fn u64s(&mut self) -> Result<Vec<u64>, ProtoError> {
        let n = self.u32()? as usize;
        let bytes = self.take(n.saturating_mul(8))?;
        Ok(bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect())
    }

    /// A [`Writer::varint`]; more than ten bytes, or bits beyond 64, are malformed.
    #[inline]
    pub fn varint(&mut self) -> Result<u64, ProtoError> {
        // Most numbers of a claim's reply (lengths, dimensions, segments) take one byte.
        if let Some(&byte) = self.buf.get(self.at)
            && byte < 0x80
        {
            self.at += 1;
            return Ok(u64::from(byte));
        }
        self.long_varint()
    }

    fn long_varint(&mut self) -> Result<u64, ProtoError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            let bits = u64::from(byte & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(ProtoError::malformed("a number beyond 64 bits"));
            }
            v |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(ProtoError::malformed("a number longer than ten bytes"))
    }

    pub fn varints(&mut self) -> Result<Vec<u64>, ProtoError> {
        self.list(1, Reader::varint)
    }

    pub fn strings(&mut self) -> Result<Vec<String>, ProtoError> {
        self.list(4, Reader::string)
    }

    pub fn duration(&mut self) -> Result<Duration, ProtoError> {
        Ok(Duration::from_micros(self.u64()?))
    }

    pub fn schema(&mut self) -> Result<FieldSchema, ProtoError> {
        let dtype =
            DType::from_code(self.u8()?).map_err(|e| ProtoError::malformed(e.to_string()))?;
        let trailing = self.opt(Reader::u64s)?;
        Ok(FieldSchema { dtype, trailing })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_count_larger_than_the_input_fails_before_allocating() {
        let mut w = Writer::new();
        w.u32(u32::MAX);
        let err = Reader::new(&w.buf).u64s().unwrap_err();
        assert!(matches!(err, ProtoError::Truncated { .. }));
    }

    #[test]
    fn a_field_written_in_place_is_the_bytes_of_the_same_field_written_apart() {
        for inner in [&b""[..], b"x", &[7u8; 300][..]] {
            let (mut apart, mut in_place) = (Writer::new(), Writer::new());
            apart.u8(9).bytes(inner).u8(9);
            in_place.u8(9).sized(|w| {
                w.buf.extend_from_slice(inner);
            });
            in_place.u8(9);
            assert_eq!(in_place.buf, apart.buf);
            let mut r = Reader::new(&in_place.buf[1..]);
            assert_eq!(r.bytes().unwrap(), inner);
        }
    }

    #[test]
    fn varints_take_as_few_bytes_as_their_number_needs_and_come_back_whole() {
        let cases: [(u64, usize); 6] =
            [(0, 1), (127, 1), (128, 2), (16_383, 2), (1 << 63, 10), (u64::MAX, 10)];
        for (v, len) in cases {
            let mut w = Writer::new();
            w.varint(v);
            assert_eq!(w.buf.len(), len, "{v}");
            let mut r = Reader::new(&w.buf);
            assert_eq!(r.varint().unwrap(), v);
            r.finish().unwrap();
        }
        let mut w = Writer::new();
        w.varints(&[5, 300, 0]);
        assert_eq!(Reader::new(&w.buf).varints().unwrap(), vec![5, 300, 0]);
    }

    #[test]
    fn a_varint_past_64_bits_or_ten_bytes_or_the_input_is_refused() {
        let beyond = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert!(matches!(Reader::new(&beyond).varint(), Err(ProtoError::Malformed(_))));
        let eleven = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert!(matches!(Reader::new(&eleven).varint(), Err(ProtoError::Malformed(_))));
        assert!(matches!(Reader::new(&[0x80, 0x80]).varint(), Err(ProtoError::Truncated { .. })));
    }

    #[test]
    fn strings_must_be_utf8() {
        let mut w = Writer::new();
        w.bytes(&[0xff, 0xfe]);
        assert!(matches!(Reader::new(&w.buf).string(), Err(ProtoError::Malformed(_))));
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut r = Reader::new(&[1, 2]);
        r.u8().unwrap();
        assert!(r.finish().is_err());
    }
}
