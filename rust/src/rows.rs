//! `update_rows`: row-structured input, for comparing tensorwise, rowwise and blockwise
//! scaling. Besides every value, it records the amax of each row and of each 1 x `block`
//! tile, and each value's magnitude relative to its row's and its tile's amax: the range
//! fit of `row_normalized` at scale `fp8_max` is (up to float32 rounding of the scale) the
//! range fit under rowwise dynamic scaling, and likewise for blocks.

use crate::histogram::F32_INF_BITS;
use crate::ingest::{bf16_to_f32, f16_to_f32, Ingestor, Source, CHUNK};
use crate::sketch::{RowSketches, Sketch};

/// Largest |x| over the finite values (0 when there are none).
#[inline]
fn finite_amax(values: &[f32]) -> f32 {
    let mut lanes = [0u32; 8];
    let mut blocks = values.chunks_exact(8);
    for b in &mut blocks {
        for (lane, &x) in lanes.iter_mut().zip(b) {
            let a = x.to_bits() & 0x7fff_ffff;
            *lane = (*lane).max(if a < F32_INF_BITS { a } else { 0 });
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(blocks.remainder()) {
        let a = x.to_bits() & 0x7fff_ffff;
        *lane = (*lane).max(if a < F32_INF_BITS { a } else { 0 });
    }
    f32::from_bits(*lanes.iter().max().unwrap())
}

/// Append |x| / amax (amax 0: |x|, the "scale 1" rule) for each x.
#[inline]
fn push_normalized(out: &mut Vec<f32>, values: &[f32], amax: f32) {
    let divisor = if amax > 0.0 { amax } else { 1.0 };
    let start = out.len();
    out.resize(start + values.len(), 0.0);
    for (o, x) in out[start..].iter_mut().zip(values) {
        *o = x.abs() / divisor;
    }
}

/// Collects values in chunk-sized batches so that short rows still feed whole chunks.
struct Staged<'a> {
    ingest: Ingestor<'a>,
    buffer: Vec<f32>,
}

impl<'a> Staged<'a> {
    fn new(sketch: &'a mut Sketch, source: Source) -> Self {
        Staged {
            ingest: Ingestor::new(sketch, source),
            buffer: Vec::with_capacity(2 * CHUNK),
        }
    }

    fn flush_if_full(&mut self) {
        if self.buffer.len() >= CHUNK {
            self.ingest.feed(&self.buffer);
            self.buffer.clear();
        }
    }

    fn finish(mut self) {
        self.ingest.feed(&self.buffer);
        self.ingest.finish();
    }
}

/// The row and tile distributions of a `[rows_count, cols]` matrix whose rows `row_at`
/// writes as float32 (the values themselves are added by the caller).
fn row_distributions(
    rows: &mut RowSketches,
    rows_count: usize,
    cols: usize,
    mut row_at: impl FnMut(usize, &mut [f32]),
) {
    let block = rows.block as usize;
    let mut row_amaxes = Vec::with_capacity(rows_count);
    let mut block_amaxes = Vec::with_capacity(rows_count * cols.div_ceil(block));
    {
        let mut row_normalized = Staged::new(&mut rows.row_normalized, Source::F32);
        let mut block_normalized = Staged::new(&mut rows.block_normalized, Source::F32);
        let mut row = vec![0f32; cols];
        for r in 0..rows_count {
            row_at(r, &mut row);
            let row_amax = finite_amax(&row);
            row_amaxes.push(row_amax);
            push_normalized(&mut row_normalized.buffer, &row, row_amax);
            row_normalized.flush_if_full();
            for tile in row.chunks(block) {
                let tile_amax = finite_amax(tile);
                block_amaxes.push(tile_amax);
                push_normalized(&mut block_normalized.buffer, tile, tile_amax);
            }
            block_normalized.flush_if_full();
        }
        row_normalized.finish();
        block_normalized.finish();
    }
    rows.row_amax.update_f32(&row_amaxes);
    rows.block_amax.update_f32(&block_amaxes);
}

/// Check `block` against the sketch, and say whether there is anything to add.
fn check_rows(
    sketch: &Sketch,
    rows_count: usize,
    cols: usize,
    block: usize,
) -> Result<bool, String> {
    if block == 0 {
        return Err("block must be at least 1".into());
    }
    let block = u32::try_from(block).map_err(|_| format!("block {block} is too large"))?;
    if let Some(rows) = sketch.rows() {
        if rows.block != block {
            return Err(format!(
                "this sketch's block distributions were built with block={}, got block={block}",
                rows.block
            ));
        }
    }
    Ok(rows_count > 0 && cols > 0)
}

impl Sketch {
    /// Add a row-major `[rows, cols]` float32 matrix and its row/tile distributions.
    pub fn update_rows_f32(
        &mut self,
        data: &[f32],
        cols: usize,
        block: usize,
    ) -> Result<(), String> {
        self.update_rows_with(data, cols, block, Sketch::update_f32, |src, dst| {
            dst.copy_from_slice(src)
        })
    }

    /// Add a row-major `[rows, cols]` float16 matrix and its row/tile distributions.
    pub fn update_rows_f16(
        &mut self,
        data: &[half::f16],
        cols: usize,
        block: usize,
    ) -> Result<(), String> {
        self.update_rows_with(data, cols, block, Sketch::update_f16, f16_to_f32)
    }

    /// Add a row-major `[rows, cols]` bfloat16 matrix (16-bit patterns).
    pub fn update_rows_bf16(
        &mut self,
        bits: &[u16],
        cols: usize,
        block: usize,
    ) -> Result<(), String> {
        self.update_rows_with(bits, cols, block, Sketch::update_bf16, bf16_to_f32)
    }

    /// The values through `update`, then the row and tile distributions of the rows
    /// `convert` turns into float32. Nothing changes if the shape or block is refused.
    fn update_rows_with<T>(
        &mut self,
        data: &[T],
        cols: usize,
        block: usize,
        update: fn(&mut Sketch, &[T]),
        convert: fn(&[T], &mut [f32]),
    ) -> Result<(), String> {
        let rows_count = check_shape(data.len(), cols)?;
        if check_rows(self, rows_count, cols, block)? {
            update(self, data);
            let rows = self.rows_mut(block as u32)?;
            row_distributions(rows, rows_count, cols, |r, out| {
                convert(&data[r * cols..(r + 1) * cols], out)
            });
        }
        Ok(())
    }
}

fn check_shape(len: usize, cols: usize) -> Result<usize, String> {
    if cols == 0 {
        return if len == 0 {
            Ok(0)
        } else {
            Err("cols is 0 but data is not empty".into())
        };
    }
    if !len.is_multiple_of(cols) {
        return Err(format!("{len} values do not form rows of {cols}"));
    }
    Ok(len / cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_and_block_distributions() {
        // Two rows of 6 with blocks of 4: tiles [1,2,3,4] [5,6] and [0,0,0,-8] [nan, 2].
        let data = [
            1.0,
            2.0,
            3.0,
            4.0,
            5.0,
            6.0,
            0.0,
            0.0,
            0.0,
            -8.0,
            f32::NAN,
            2.0,
        ];
        let mut s = Sketch::new(7);
        s.update_rows_f32(&data, 6, 4).unwrap();
        assert_eq!(s.count(), 12);
        assert_eq!(s.nan(), 1);
        let rows = s.rows().unwrap();
        assert_eq!(rows.row_amax.count(), 2);
        assert_eq!((rows.row_amax.min(), rows.row_amax.max()), (6.0, 8.0));
        assert_eq!(rows.block_amax.count(), 4);
        assert_eq!((rows.block_amax.min(), rows.block_amax.max()), (2.0, 8.0));
        assert_eq!(rows.row_normalized.count(), 12);
        assert_eq!(rows.row_normalized.nan(), 1);
        assert_eq!(rows.row_normalized.max(), 1.0);
        assert_eq!(rows.block_normalized.zeros(), 3);
        // 1 + 2 + 3 + 4 over 4, 5/6 + 1, 8/8, 2/2
        let expected = (1.0 + 2.0 + 3.0 + 4.0) / 4.0 + 5.0 / 6.0 + 1.0 + 1.0 + 1.0;
        assert!((rows.block_normalized.sum() - expected).abs() < 1e-6);
    }

    #[test]
    fn block_width_must_match_and_failures_change_nothing() {
        let mut s = Sketch::new(7);
        s.update_rows_f32(&[1.0; 8], 4, 2).unwrap();
        let before = s.count();
        assert!(s.update_rows_f32(&[1.0; 8], 4, 3).is_err());
        assert!(s.update_rows_f32(&[1.0; 7], 4, 2).is_err());
        assert!(s.update_rows_f32(&[1.0; 8], 4, 0).is_err());
        assert_eq!(s.count(), before);
    }

    #[test]
    fn many_short_rows_equal_one_update() {
        let data: Vec<f32> = (0..50_000)
            .map(|i| ((i * 7919) % 1000) as f32 - 500.0)
            .collect();
        let mut rows = Sketch::new(7);
        rows.update_rows_f32(&data, 10, 128).unwrap();
        let mut flat = Sketch::new(7);
        flat.update_f32(&data);
        assert_eq!(rows.histogram(), flat.histogram());
        assert_eq!(rows.zeros(), flat.zeros());
        let r = rows.rows().unwrap();
        assert_eq!(r.row_amax.count(), 5000);
        assert_eq!(r.block_amax.count(), 5000);
    }
}
