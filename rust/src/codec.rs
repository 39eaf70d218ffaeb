//! Versioned, checksummed bytes for sketches and error accumulators.
//!
//! Layout (little-endian): a 4-byte magic (`LKSK` sketch, `LKEA` error accumulator), a u16
//! format version, the body, and a CRC-32 of everything before it. Counts are LEB128
//! varints, floats their raw IEEE bits. Sketch body, version 1:
//!
//! ```text
//! mantissa_bits u8 | count zeros subnormals nan pos_inf neg_inf: varint
//! min max: f32 | sum sum_sq: f64
//! first_key len: varint | len bucket counts: varint | len edge counts: varint
//! has_rows u8 | if 1: block varint, then the bodies of row_amax, block_amax,
//!                      row_normalized, block_normalized (each with has_rows = 0)
//! ```
//!
//! Error accumulator body, version 1: `n_values varint | sum_sq_error sum_sq_reference
//! max_abs: f64 | n_batches varint | batch_mean batch_m2: f64 | row-error sketch body`.
//!
//! Decoding checks everything it reads (magic, version, checksum, ranges, that the counts
//! add up, no trailing bytes) and returns an error rather than panicking.

use crate::error_acc::ErrorAccumulator;
use crate::histogram::{key_count, LogHistogram, MAX_MANTISSA_BITS, MIN_MANTISSA_BITS};
use crate::sketch::{RowSketches, Sketch};

pub const SKETCH_MAGIC: &[u8; 4] = b"LKSK";
pub const ERROR_ACC_MAGIC: &[u8; 4] = b"LKEA";
pub const FORMAT_VERSION: u16 = 1;

#[derive(Default)]
struct Writer {
    bytes: Vec<u8>,
}

impl Writer {
    fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.bytes.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.bytes.push(v as u8);
    }
    fn f32(&mut self, v: f32) {
        self.bytes.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.bytes.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    fn header(&mut self, magic: &[u8; 4]) {
        self.bytes.extend_from_slice(magic);
        self.bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    }
    fn finish(mut self) -> Vec<u8> {
        let crc = crc32fast::hash(&self.bytes);
        self.bytes.extend_from_slice(&crc.to_le_bytes());
        self.bytes
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.bytes.len() - self.at < n {
            return Err("truncated".into());
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                return Err("varint overflows 64 bits".into());
            }
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes".into())
    }
    fn f32(&mut self) -> Result<f32, String> {
        Ok(f32::from_bits(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap(),
        )))
    }
    fn f64(&mut self) -> Result<f64, String> {
        Ok(f64::from_bits(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap(),
        )))
    }
}

/// Check magic, version and checksum; return a reader over the body.
fn open<'a>(bytes: &'a [u8], magic: &[u8; 4], what: &str) -> Result<Reader<'a>, String> {
    if bytes.len() < 10 || &bytes[..4] != magic {
        let other = if bytes.len() >= 4
            && (&bytes[..4] == SKETCH_MAGIC || &bytes[..4] == ERROR_ACC_MAGIC)
        {
            " (it is another loka-stats object)"
        } else {
            ""
        };
        return Err(format!(
            "not a serialized {what}{other}: bad magic or too short"
        ));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != FORMAT_VERSION {
        return Err(format!(
            "{what} in format version {version}; this loka-stats reads version {FORMAT_VERSION}"
        ));
    }
    let (payload, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(payload) != u32::from_le_bytes(crc.try_into().unwrap()) {
        return Err(format!("{what} bytes are corrupt: checksum mismatch"));
    }
    Ok(Reader {
        bytes: payload,
        at: 6,
    })
}

fn close(reader: Reader<'_>) -> Result<(), String> {
    if reader.at != reader.bytes.len() {
        return Err(format!(
            "{} unexpected trailing bytes",
            reader.bytes.len() - reader.at
        ));
    }
    Ok(())
}

fn write_sketch_body(w: &mut Writer, s: &Sketch) {
    w.u8(s.mantissa_bits() as u8);
    for v in [s.count, s.zeros, s.subnormals, s.nan, s.pos_inf, s.neg_inf] {
        w.varint(v);
    }
    w.f32(s.min);
    w.f32(s.max);
    w.f64(s.sum);
    w.f64(s.sum_sq);
    let (first, counts, edges) = s.hist.parts();
    w.varint(first as u64);
    w.varint(counts.len() as u64);
    for &c in counts {
        w.varint(c);
    }
    for &e in edges {
        w.varint(e);
    }
    match &s.rows {
        None => w.u8(0),
        Some(rows) => {
            w.u8(1);
            w.varint(rows.block as u64);
            for sub in [
                &rows.row_amax,
                &rows.block_amax,
                &rows.row_normalized,
                &rows.block_normalized,
            ] {
                write_sketch_body(w, sub);
            }
        }
    }
}

fn read_sketch_body(r: &mut Reader<'_>, nested: bool) -> Result<Sketch, String> {
    let m = r.u8()? as u32;
    if !(MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS).contains(&m) {
        return Err(format!("mantissa_bits {m} out of range"));
    }
    let mut s = Sketch::new(m);
    s.count = r.varint()?;
    s.zeros = r.varint()?;
    s.subnormals = r.varint()?;
    s.nan = r.varint()?;
    s.pos_inf = r.varint()?;
    s.neg_inf = r.varint()?;
    s.min = r.f32()?;
    s.max = r.f32()?;
    s.sum = r.f64()?;
    s.sum_sq = r.f64()?;
    let first = r.varint()?;
    let len = r.varint()?;
    if first.saturating_add(len) > key_count(m) as u64 {
        return Err("histogram key range exceeds the float32 range".into());
    }
    let read_counts =
        |r: &mut Reader<'_>| -> Result<Vec<u64>, String> { (0..len).map(|_| r.varint()).collect() };
    let counts = read_counts(r)?;
    let edges = read_counts(r)?;
    s.hist = LogHistogram::from_parts(m, first as u32, counts, edges)?;
    let specials = [s.zeros, s.nan, s.pos_inf, s.neg_inf]
        .iter()
        .try_fold(0u64, |acc, &v| acc.checked_add(v))
        .ok_or("counts overflow")?;
    let bucketed = s
        .hist
        .iter()
        .try_fold(0u64, |acc, (_, c, _)| acc.checked_add(c));
    if bucketed.and_then(|b| b.checked_add(specials)) != Some(s.count) {
        return Err("counts do not add up to the total".into());
    }
    if s.subnormals > s.count - specials {
        return Err("more subnormals than nonzero finite values".into());
    }
    let finite = s.finite();
    let extremes_ok = if finite == 0 {
        s.min == f32::INFINITY && s.max == f32::NEG_INFINITY
    } else {
        s.min.is_finite() && s.max.is_finite() && s.min <= s.max
    };
    if !(extremes_ok && s.sum.is_finite() && s.sum_sq >= 0.0 && s.sum_sq.is_finite()) {
        return Err("min/max/sum fields are inconsistent".into());
    }
    match r.u8()? {
        0 => {}
        1 if !nested => {
            let block = r.varint()?;
            if block == 0 || block > u32::MAX as u64 {
                return Err(format!("block {block} out of range"));
            }
            let mut next = || read_sketch_body(r, true);
            let row_amax = next()?;
            let block_amax = next()?;
            let row_normalized = next()?;
            let block_normalized = next()?;
            if [&row_amax, &block_amax, &row_normalized, &block_normalized]
                .iter()
                .any(|x| x.mantissa_bits() != m)
            {
                return Err("row distributions differ in resolution".into());
            }
            s.rows = Some(Box::new(RowSketches {
                block: block as u32,
                row_amax,
                block_amax,
                row_normalized,
                block_normalized,
            }));
        }
        flag => return Err(format!("bad row-distribution flag {flag}")),
    }
    Ok(s)
}

pub fn sketch_to_bytes(s: &Sketch) -> Vec<u8> {
    let mut w = Writer::default();
    w.header(SKETCH_MAGIC);
    write_sketch_body(&mut w, s);
    w.finish()
}

pub fn sketch_from_bytes(bytes: &[u8]) -> Result<Sketch, String> {
    let mut r = open(bytes, SKETCH_MAGIC, "Sketch")?;
    let s = read_sketch_body(&mut r, false)?;
    close(r)?;
    Ok(s)
}

pub fn error_acc_to_bytes(acc: &ErrorAccumulator) -> Vec<u8> {
    let mut w = Writer::default();
    w.header(ERROR_ACC_MAGIC);
    w.varint(acc.n_values);
    w.f64(acc.sum_sq_error);
    w.f64(acc.sum_sq_reference);
    w.f64(acc.max_abs);
    w.varint(acc.n_batches);
    w.f64(acc.batch_mean);
    w.f64(acc.batch_m2);
    write_sketch_body(&mut w, &acc.row_errors);
    w.finish()
}

pub fn error_acc_from_bytes(bytes: &[u8]) -> Result<ErrorAccumulator, String> {
    let mut r = open(bytes, ERROR_ACC_MAGIC, "ErrorAccumulator")?;
    let acc = ErrorAccumulator {
        n_values: r.varint()?,
        sum_sq_error: r.f64()?,
        sum_sq_reference: r.f64()?,
        max_abs: r.f64()?,
        n_batches: r.varint()?,
        batch_mean: r.f64()?,
        batch_m2: r.f64()?,
        row_errors: read_sketch_body(&mut r, true)?,
    };
    close(r)?;
    if acc.row_errors.mantissa_bits() != ErrorAccumulator::new().row_errors.mantissa_bits() {
        return Err("per-row error sketch has an unexpected resolution".into());
    }
    let non_negative = |v: f64| v >= 0.0; // also false for NaN
    if ![
        acc.sum_sq_error,
        acc.sum_sq_reference,
        acc.max_abs,
        acc.batch_m2,
    ]
    .into_iter()
    .all(non_negative)
        || acc.batch_mean.is_nan()
        || (acc.n_batches > acc.n_values)
    {
        return Err("error accumulator fields are inconsistent".into());
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_sketch() -> Sketch {
        let data: Vec<f32> = (0..3000)
            .map(|i| match i % 50 {
                0 => f32::NAN,
                1 => 0.0,
                2 => f32::NEG_INFINITY,
                _ => ((i * 37) % 1001) as f32 * 0.013 - 6.0,
            })
            .collect();
        let mut s = Sketch::new(7);
        s.update_rows_f32(&data, 100, 32).unwrap();
        s
    }

    #[test]
    fn sketch_round_trip_is_identical() {
        let s = sample_sketch();
        let bytes = sketch_to_bytes(&s);
        let back = sketch_from_bytes(&bytes).unwrap();
        assert_eq!(sketch_to_bytes(&back), bytes);
        assert_eq!(back.histogram(), s.histogram());
        assert_eq!(back.rows().unwrap().block, 32);
    }

    #[test]
    fn error_acc_round_trip_is_identical() {
        let mut acc = ErrorAccumulator::new();
        acc.update(&[1.0f32, 2.0, 3.0, 4.0], &[1.1, 2.0, 2.9, 4.0], Some(2))
            .unwrap();
        let bytes = error_acc_to_bytes(&acc);
        assert_eq!(
            error_acc_to_bytes(&error_acc_from_bytes(&bytes).unwrap()),
            bytes
        );
    }

    #[test]
    fn accumulator_with_a_foreign_row_sketch_is_refused() {
        let mut w = Writer::default();
        w.header(ERROR_ACC_MAGIC);
        w.varint(0);
        for _ in 0..3 {
            w.f64(0.0);
        }
        w.varint(0);
        w.f64(0.0);
        w.f64(0.0);
        write_sketch_body(&mut w, &Sketch::new(9));
        assert!(error_acc_from_bytes(&w.finish())
            .unwrap_err()
            .contains("resolution"));
    }

    #[test]
    fn foreign_and_future_bytes_are_refused() {
        let bytes = sketch_to_bytes(&sample_sketch());
        assert!(error_acc_from_bytes(&bytes)
            .unwrap_err()
            .contains("another loka-stats"));
        let mut future = bytes.clone();
        future[4] = 2;
        assert!(sketch_from_bytes(&future)
            .unwrap_err()
            .contains("version 2"));
        assert!(sketch_from_bytes(b"").is_err());
        assert!(sketch_from_bytes(&bytes[..bytes.len() - 1]).is_err());
    }

    /// Re-seal a body with a valid checksum, to reach the checks behind it.
    fn sealed(body: &[u8]) -> Vec<u8> {
        let mut b = body.to_vec();
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_single_byte_change_is_detected(pos in any::<prop::sample::Index>(), flip in 1u8..=255) {
            let bytes = sketch_to_bytes(&sample_sketch());
            let mut bad = bytes.clone();
            let i = pos.index(bad.len());
            bad[i] ^= flip;
            prop_assert!(sketch_from_bytes(&bad).is_err());
        }

        #[test]
        fn resealed_garbage_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..400), cut in any::<prop::sample::Index>()) {
            let good = sketch_to_bytes(&sample_sketch());
            let body = &good[..good.len() - 4];
            let keep = cut.index(body.len());
            let mut mixed = body[..keep].to_vec();
            mixed.extend_from_slice(&tail);
            let _ = sketch_from_bytes(&sealed(&mixed));
            let mut acc_bytes = ERROR_ACC_MAGIC.to_vec();
            acc_bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
            acc_bytes.extend_from_slice(&tail);
            let _ = error_acc_from_bytes(&sealed(&acc_bytes));
        }
    }
}
