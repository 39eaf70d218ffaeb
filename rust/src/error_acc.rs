//! Accumulated error of an approximation against a reference, batch by batch.
//!
//! Each `update` is one batch. Totals give the SQNR, relative Frobenius error and max
//! absolute error over everything seen; the per-batch relative Frobenius errors feed a
//! running mean and variance (Welford, merged with Chan et al.'s formula) from which a
//! caller builds confidence bounds; 2-D batches also give each row's relative error, kept
//! in a sketch for quantiles.

use crate::sketch::Sketch;

#[derive(Clone, Debug)]
pub struct ErrorAccumulator {
    pub(crate) n_values: u64,
    pub(crate) sum_sq_error: f64,
    pub(crate) sum_sq_reference: f64,
    pub(crate) max_abs: f64,
    pub(crate) n_batches: u64,
    pub(crate) batch_mean: f64,
    /// Sum of squared deviations of the batch errors from their mean.
    pub(crate) batch_m2: f64,
    pub(crate) row_errors: Sketch,
}

impl Default for ErrorAccumulator {
    fn default() -> Self {
        ErrorAccumulator::new()
    }
}

/// `sqrt(err / reference)` with 0/0 = 0 and x/0 = inf.
fn relative(sum_sq_error: f64, sum_sq_reference: f64) -> f64 {
    if sum_sq_error == 0.0 {
        0.0
    } else {
        (sum_sq_error / sum_sq_reference).sqrt()
    }
}

impl ErrorAccumulator {
    pub fn new() -> Self {
        ErrorAccumulator {
            n_values: 0,
            sum_sq_error: 0.0,
            sum_sq_reference: 0.0,
            max_abs: 0.0,
            n_batches: 0,
            batch_mean: 0.0,
            batch_m2: 0.0,
            row_errors: Sketch::default(),
        }
    }

    /// Add one batch. `cols` splits it into rows of that length for per-row errors (None:
    /// a 1-D batch). Fails, changing nothing, on mismatched lengths, empty or non-finite
    /// input, or an all-zero reference with a nonzero approximation.
    pub fn update<T: Copy + Into<f64>>(
        &mut self,
        reference: &[T],
        approx: &[T],
        cols: Option<usize>,
    ) -> Result<(), String> {
        if reference.len() != approx.len() {
            return Err(format!(
                "reference has {} values, approx {}",
                reference.len(),
                approx.len()
            ));
        }
        if reference.is_empty() {
            return Err("empty batch: the relative error of no values is undefined".into());
        }
        for (name, values) in [("reference", reference), ("approx", approx)] {
            let bad = values.iter().filter(|&&v| !v.into().is_finite()).count();
            if bad > 0 {
                return Err(format!(
                    "{name} has {bad} non-finite values (NaN or Inf); the error against them is undefined"
                ));
            }
        }
        let (mut err, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
        let mut row_errors = Vec::new();
        let row_len = cols.unwrap_or(reference.len()).max(1);
        for (r_row, a_row) in reference.chunks(row_len).zip(approx.chunks(row_len)) {
            let (mut row_err, mut row_norm) = (0.0f64, 0.0f64);
            for (&r, &a) in r_row.iter().zip(a_row) {
                let (r, a) = (r.into(), a.into());
                let d = a - r;
                row_err += d * d;
                row_norm += r * r;
                max_abs = max_abs.max(d.abs());
            }
            err += row_err;
            norm += row_norm;
            row_errors.push(if row_err == 0.0 {
                0.0
            } else if row_norm == 0.0 {
                f32::INFINITY
            } else {
                (row_err / row_norm).sqrt() as f32
            });
        }
        if norm == 0.0 && err > 0.0 {
            return Err(
                "reference is all zeros but approx is not: the relative error is undefined".into(),
            );
        }
        let batch_error = relative(err, norm);
        self.n_values += reference.len() as u64;
        self.sum_sq_error += err;
        self.sum_sq_reference += norm;
        self.max_abs = self.max_abs.max(max_abs);
        self.n_batches += 1;
        let delta = batch_error - self.batch_mean;
        self.batch_mean += delta / self.n_batches as f64;
        self.batch_m2 += delta * (batch_error - self.batch_mean);
        if cols.is_some() {
            self.row_errors.update_f32(&row_errors);
        }
        Ok(())
    }

    pub fn merge(&mut self, other: &ErrorAccumulator) {
        let (na, nb) = (self.n_batches as f64, other.n_batches as f64);
        if other.n_batches > 0 {
            let n = na + nb;
            let delta = other.batch_mean - self.batch_mean;
            self.batch_mean += delta * nb / n;
            self.batch_m2 += other.batch_m2 + delta * delta * na * nb / n;
        }
        self.n_batches += other.n_batches;
        self.n_values += other.n_values;
        self.sum_sq_error += other.sum_sq_error;
        self.sum_sq_reference += other.sum_sq_reference;
        self.max_abs = self.max_abs.max(other.max_abs);
        self.row_errors
            .merge(&other.row_errors)
            .expect("row-error sketches share one resolution");
    }

    pub fn n_batches(&self) -> u64 {
        self.n_batches
    }
    pub fn n_values(&self) -> u64 {
        self.n_values
    }
    /// Relative Frobenius error over everything seen (NaN before any batch).
    pub fn rel_fro(&self) -> f64 {
        if self.n_batches == 0 {
            f64::NAN
        } else {
            relative(self.sum_sq_error, self.sum_sq_reference)
        }
    }
    /// Signal-to-quantization-noise ratio in dB (inf when the approximation is exact).
    pub fn sqnr_db(&self) -> f64 {
        if self.n_batches == 0 {
            f64::NAN
        } else if self.sum_sq_error == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.sum_sq_reference / self.sum_sq_error).log10()
        }
    }
    pub fn max_abs(&self) -> f64 {
        if self.n_batches == 0 {
            f64::NAN
        } else {
            self.max_abs
        }
    }
    /// Mean of the per-batch relative Frobenius errors.
    pub fn batch_mean(&self) -> f64 {
        if self.n_batches == 0 {
            f64::NAN
        } else {
            self.batch_mean
        }
    }
    /// Sample variance (ddof = 1) of the per-batch errors; NaN below two batches.
    pub fn batch_var(&self) -> f64 {
        if self.n_batches < 2 {
            f64::NAN
        } else {
            self.batch_m2 / (self.n_batches - 1) as f64
        }
    }
    pub fn row_errors(&self) -> &Sketch {
        &self.row_errors
    }

    /// Quantile (numpy 'linear') of the per-row relative errors; rows whose reference is
    /// zero but approximation is not count as +inf. None before any 2-D batch.
    pub fn row_rel_err_quantile(&self, q: f64) -> Option<f64> {
        let rows = &self.row_errors;
        let n = rows.count();
        if n == 0 {
            return None;
        }
        let finite = rows.finite();
        let h = (n - 1) as f64 * q;
        let (k, t) = (h.floor() as u64, h - h.floor());
        if k >= finite || (t > 0.0 && k + 1 >= finite) {
            return Some(f64::INFINITY);
        }
        // Rank k among all rows is rank k among the finite ones (infinities sort last).
        let qf = if finite > 1 {
            (k as f64 + t) / (finite - 1) as f64
        } else {
            0.0
        };
        rows.quantiles(&[qf.min(1.0)]).map(|v| v[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_and_batch_statistics() {
        let mut acc = ErrorAccumulator::new();
        acc.update(&[3.0f32, 4.0], &[3.0, 4.5], None).unwrap();
        acc.update(&[1.0f32, 0.0], &[1.0, 1.0], None).unwrap();
        assert_eq!(acc.n_batches(), 2);
        let e1 = 0.5 / 5.0;
        let e2 = 1.0;
        assert!((acc.batch_mean() - (e1 + e2) / 2.0).abs() < 1e-12);
        assert!((acc.batch_var() - (e1 - e2) * (e1 - e2) / 2.0).abs() < 1e-12);
        assert!((acc.rel_fro() - (1.25f64 / 26.0).sqrt()).abs() < 1e-12);
        assert_eq!(acc.max_abs(), 1.0);
        assert!(acc.row_rel_err_quantile(0.5).is_none());
    }

    #[test]
    fn merge_equals_sequential_updates() {
        let batches: Vec<(Vec<f32>, Vec<f32>)> = (0..7)
            .map(|b| {
                let r: Vec<f32> = (0..12).map(|i| (i * (b + 3)) as f32 - 10.0).collect();
                let a: Vec<f32> = r.iter().map(|x| x * (1.0 + 0.01 * b as f32)).collect();
                (r, a)
            })
            .collect();
        let mut all = ErrorAccumulator::new();
        let (mut left, mut right) = (ErrorAccumulator::new(), ErrorAccumulator::new());
        for (i, (r, a)) in batches.iter().enumerate() {
            all.update(r, a, Some(4)).unwrap();
            if i < 3 { &mut left } else { &mut right }
                .update(r, a, Some(4))
                .unwrap();
        }
        left.merge(&right);
        assert_eq!(left.n_batches(), all.n_batches());
        assert!((left.batch_mean() - all.batch_mean()).abs() < 1e-12);
        assert!((left.batch_var() - all.batch_var()).abs() < 1e-12);
        assert!((left.rel_fro() - all.rel_fro()).abs() < 1e-12);
        assert_eq!(left.row_errors().histogram(), all.row_errors().histogram());
    }

    #[test]
    fn bad_batches_change_nothing() {
        let mut acc = ErrorAccumulator::new();
        assert!(acc.update(&[1.0f32], &[1.0, 2.0], None).is_err());
        assert!(acc.update::<f32>(&[], &[], None).is_err());
        assert!(acc.update(&[1.0f32], &[f32::NAN], None).is_err());
        assert!(acc.update(&[0.0f32], &[1.0], None).is_err());
        assert_eq!(acc.n_batches(), 0);
        assert!(acc.rel_fro().is_nan());
    }

    #[test]
    fn infinite_row_errors_sort_last() {
        let mut acc = ErrorAccumulator::new();
        // rows: exact, 10% off, zero reference with a nonzero approx (infinite)
        acc.update(&[1.0f32, 1.0, 0.0, 1.0], &[1.0f32, 1.1, 0.5, 1.0], Some(1))
            .unwrap();
        assert_eq!(acc.row_rel_err_quantile(0.0), Some(0.0));
        assert_eq!(acc.row_rel_err_quantile(1.0), Some(f64::INFINITY));
        let median = acc.row_rel_err_quantile(0.5).unwrap();
        assert!(median < 0.1);
    }
}
