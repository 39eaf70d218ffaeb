//! How well a sketched distribution fits an FP8 format at a given scale.
//!
//! For a finite value x and scale s, let y = x*s rounded to float32 and q its FP8 code
//! (saturating, round-to-nearest-even). Then x is
//! - *saturated* when |y| > max,
//! - *underflow* when x != 0 and q is zero (|y| <= min_subnormal / 2),
//! - *subnormal* when q is a nonzero subnormal code.
//!
//! Fractions are of the finite values (zeros included in the denominator). The histogram
//! knows exactly the values on bucket edges; the others are taken as spread uniformly over
//! their bucket. Every threshold above is a bucket edge once scaled by a power of two (for
//! mantissa_bits >= 3), so at power-of-two scales the fractions are exact counts. At other
//! scales a threshold can fall inside a bucket, whose values are then split in proportion
//! to the bucket's length on either side.
//!
//! The predicted relative error is `sqrt(sum (dequant(quant(x)) - x)^2 / sum x^2)`: exact
//! for edge values, and for the rest the rounding error integrated over the bucket, the
//! saturation error included; the denominator is the sketch's exact sum of squares.

use crate::fp8::{pow2_f64, Fp8Format};
use crate::histogram;
use crate::sketch::Sketch;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RangeFit {
    pub format: Fp8Format,
    pub scale: f32,
    pub saturated: f64,
    pub underflow: f64,
    pub subnormal: f64,
    pub predicted_rel_error: f64,
}

/// The FP8 grid of nonnegative values, in float64.
struct Grid {
    max: f64,
    min_normal: f64,
    min_subnormal: f64,
    mantissa_bits: i32,
}

impl Grid {
    fn new(format: &Fp8Format) -> Self {
        Grid {
            max: format.max as f64,
            min_normal: format.min_normal() as f64,
            min_subnormal: format.min_subnormal() as f64,
            mantissa_bits: format.mantissa_bits as i32,
        }
    }

    fn step_at(&self, g: f64) -> f64 {
        if g < self.min_normal {
            self.min_subnormal
        } else {
            let e = ((g.to_bits() >> 52) & 0x7ff) as i32 - 1023;
            pow2_f64(e - self.mantissa_bits)
        }
    }

    /// Largest grid point <= y (y >= 0).
    fn floor(&self, y: f64) -> f64 {
        if y >= self.max {
            return self.max;
        }
        let step = self.step_at(y);
        (y / step).floor() * step
    }

    /// The grid point y rounds to and the end of the interval rounding to it.
    fn cell(&self, y: f64) -> (f64, f64) {
        let below = self.floor(y);
        if below == self.max {
            return (self.max, f64::INFINITY);
        }
        let above = below + self.step_at(below);
        let mid = 0.5 * (below + above);
        if y < mid {
            (below, mid)
        } else if above == self.max {
            (above, f64::INFINITY)
        } else {
            (above, 0.5 * (above + above + self.step_at(above)))
        }
    }

    /// Integral of (Q(y) - y)^2 over [a, b], Q = round to the grid with saturation.
    fn squared_error_integral(&self, a: f64, b: f64) -> f64 {
        let mut total = 0.0;
        let mut u = a;
        while u < b {
            let (q, end) = self.cell(u);
            let v = end.min(b);
            let (du, dv) = (u - q, v - q);
            total += (v - u) * (du * du + du * dv + dv * dv) / 3.0;
            u = v;
        }
        total
    }
}

/// Length of the overlap of (a, b) with (lo, hi).
fn overlap(a: f64, b: f64, lo: f64, hi: f64) -> f64 {
    (b.min(hi) - a.max(lo)).max(0.0)
}

/// Running totals of a range fit, in numbers of values and squared error (x units).
struct Tally<'a> {
    format: &'a Fp8Format,
    scale: f32,
    grid: Grid,
    table: [f32; 256],
    saturated: f64,
    underflow: f64,
    subnormal: f64,
    squared_error: f64,
}

impl<'a> Tally<'a> {
    fn new(format: &'a Fp8Format, scale: f32) -> Self {
        Tally {
            format,
            scale,
            grid: Grid::new(format),
            table: format.decode_table(),
            saturated: 0.0,
            underflow: 0.0,
            subnormal: 0.0,
            squared_error: 0.0,
        }
    }

    /// `count` values equal to `x` (a float32), classified by actually quantizing it.
    fn exact(&mut self, x: f64, count: f64) {
        let x = x as f32;
        let code = self.format.quantize(x, self.scale);
        let magnitude = code & 0x7f;
        if (x * self.scale).abs() > self.format.max {
            self.saturated += count;
        }
        if magnitude == 0 {
            self.underflow += count;
        } else if magnitude >> self.format.mantissa_bits == 0 {
            self.subnormal += count;
        }
        let err = (self.table[code as usize] / self.scale) as f64 - x as f64;
        self.squared_error += count * err * err;
    }

    /// `count` values spread uniformly over the open interval (lo, hi).
    fn spread(&mut self, lo: f64, hi: f64, count: f64) {
        let s = self.scale as f64;
        let (a, b) = (lo * s, hi * s);
        let flush_limit = self.grid.min_subnormal / 2.0;
        let subnormal_limit = self.grid.min_normal - flush_limit;
        let per_length = count / (b - a);
        self.saturated += per_length * overlap(a, b, self.grid.max, f64::INFINITY);
        self.underflow += per_length * overlap(a, b, 0.0, flush_limit);
        self.subnormal += per_length * overlap(a, b, flush_limit, subnormal_limit);
        self.squared_error += per_length * self.grid.squared_error_integral(a, b) / (s * s);
    }
}

/// The range fit of a sketch's values at one scale (`scale` finite and positive).
pub fn range_fit(sketch: &Sketch, format: &Fp8Format, scale: f32) -> RangeFit {
    let finite = sketch.finite();
    if finite == 0 {
        return RangeFit {
            format: *format,
            scale,
            saturated: f64::NAN,
            underflow: f64::NAN,
            subnormal: f64::NAN,
            predicted_rel_error: f64::NAN,
        };
    }
    let m = sketch.mantissa_bits();
    let amax = sketch.amax();
    let mut tally = Tally::new(format, scale);
    for (key, count, edges) in sketch.histogram().iter() {
        let lo = histogram::lower_edge(key, m);
        let mut hi = histogram::upper_edge(key, m);
        let mut off_edge = count - edges;
        if edges > 0 {
            tally.exact(lo, edges as f64);
        }
        if amax > lo && amax < hi && off_edge > 0 {
            // The top bucket: one of its values is amax itself, the rest lie below it.
            tally.exact(amax, 1.0);
            off_edge -= 1;
            hi = amax;
        }
        if off_edge > 0 {
            tally.spread(lo, hi, off_edge as f64);
        }
    }
    let n = finite as f64;
    let predicted_rel_error = if sketch.sum_sq() > 0.0 {
        (tally.squared_error / sketch.sum_sq()).sqrt()
    } else {
        0.0
    };
    RangeFit {
        format: *format,
        scale,
        saturated: tally.saturated / n,
        underflow: tally.underflow / n,
        subnormal: tally.subnormal / n,
        predicted_rel_error,
    }
}

/// The scale minimizing the predicted relative error. With `pow2`, over powers of two;
/// otherwise the best power of two is refined by a fine grid and golden-section search over
/// log2(scale) within an octave of it, the dynamic scale `max / amax` also tried.
pub fn optimal_scale(sketch: &Sketch, format: &Fp8Format, pow2: bool) -> RangeFit {
    let amax = sketch.amax();
    if amax == 0.0 {
        return range_fit(sketch, format, 1.0);
    }
    let fit_at = |log2_scale: f64| {
        let scale = (2f64.powf(log2_scale) as f32).clamp(f32::MIN_POSITIVE, f32::MAX);
        range_fit(sketch, format, scale)
    };
    let better = |a: RangeFit, b: RangeFit| {
        if b.predicted_rel_error < a.predicted_rel_error {
            b
        } else {
            a
        }
    };
    let dynamic = (format.max as f64 / amax).log2();
    let k0 = dynamic.floor() as i32;
    let mut best = fit_at(k0 as f64);
    for k in (k0 - 24)..=(k0 + 8) {
        if (-126..=127).contains(&k) {
            best = better(best, fit_at(k as f64));
        }
    }
    if pow2 {
        return best;
    }
    let centre = (best.scale as f64).log2();
    best = better(best, fit_at(dynamic));
    const STEPS: i32 = 32;
    for i in -STEPS..=STEPS {
        best = better(best, fit_at(centre + i as f64 / STEPS as f64));
    }
    // Golden-section search around the best grid point.
    let (mut lo, mut hi) = (
        (best.scale as f64).log2() - 1.0 / STEPS as f64,
        (best.scale as f64).log2() + 1.0 / STEPS as f64,
    );
    let ratio = (5f64.sqrt() - 1.0) / 2.0;
    let mut c = hi - ratio * (hi - lo);
    let mut d = lo + ratio * (hi - lo);
    let (mut fc, mut fd) = (fit_at(c), fit_at(d));
    for _ in 0..24 {
        if fc.predicted_rel_error < fd.predicted_rel_error {
            hi = d;
            d = c;
            fd = fc;
            c = hi - ratio * (hi - lo);
            fc = fit_at(c);
        } else {
            lo = c;
            c = d;
            fc = fd;
            d = lo + ratio * (hi - lo);
            fd = fit_at(d);
        }
    }
    better(better(best, fc), fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{E4M3, E5M2, FORMATS};
    use proptest::prelude::*;

    fn brute_force(values: &[f32], format: &Fp8Format, scale: f32) -> (u64, u64, u64, f64) {
        let table = format.decode_table();
        let (mut sat, mut under, mut sub) = (0, 0, 0);
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for &x in values.iter().filter(|x| x.is_finite()) {
            let y = x * scale;
            let q = format.quantize(x, scale);
            sat += (y.abs() > format.max) as u64;
            under += (x != 0.0 && q & 0x7f == 0) as u64;
            sub += (q & 0x7f != 0 && (q & 0x7f) >> format.mantissa_bits == 0) as u64;
            let d = (table[q as usize] / scale) as f64 - x as f64;
            err += d * d;
            norm += (x as f64) * (x as f64);
        }
        (sat, under, sub, (err / norm).sqrt())
    }

    fn wide_values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|i| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                let v = (2f64.powf(u * 40.0 - 20.0)) as f32;
                match i % 10 {
                    0 => 448.0 / 64.0,  // exactly at e4m3 max for scale 64
                    1 => 1.875 / 128.0, // on the e4m3 subnormal/normal rounding tie
                    2 => 0.0,
                    3 => -v,
                    _ => v,
                }
            })
            .collect()
    }

    #[test]
    fn fractions_equal_brute_force_at_powers_of_two() {
        let values = wide_values(50_000, 11);
        let mut s = Sketch::new(7);
        s.update_f32(&values);
        let n = s.finite() as f64;
        for format in FORMATS {
            for k in -30..30 {
                let scale = 2f32.powi(k);
                let fit = range_fit(&s, &format, scale);
                let (sat, under, sub, _) = brute_force(&values, &format, scale);
                assert_eq!(
                    (fit.saturated * n).round() as u64,
                    sat,
                    "{} 2^{k}",
                    format.name
                );
                assert_eq!(
                    (fit.underflow * n).round() as u64,
                    under,
                    "{} 2^{k}",
                    format.name
                );
                assert_eq!(
                    (fit.subnormal * n).round() as u64,
                    sub,
                    "{} 2^{k}",
                    format.name
                );
                assert!((fit.saturated * n - sat as f64).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn predicted_error_is_close_for_smooth_data() {
        let values = wide_values(200_000, 5);
        let mut s = Sketch::new(7);
        s.update_f32(&values);
        for (format, scale) in [(E4M3, 1.0f32), (E4M3, 37.3), (E5M2, 0.01)] {
            let fit = range_fit(&s, &format, scale);
            let (_, _, _, measured) = brute_force(&values, &format, scale);
            let rel = (fit.predicted_rel_error - measured).abs() / measured;
            assert!(
                rel < 0.05,
                "{} scale {scale}: {} vs {measured}",
                format.name,
                fit.predicted_rel_error
            );
        }
    }

    #[test]
    fn squared_error_integral_matches_numeric_integration() {
        let grid = Grid::new(&E4M3);
        for (a, b) in [(0.0, 0.01), (1.0, 1.3), (430.0, 470.0), (0.003, 0.0041)] {
            let n = 200_000;
            let h = (b - a) / n as f64;
            let numeric: f64 = (0..n)
                .map(|i| {
                    let y = a + (i as f64 + 0.5) * h;
                    let q = E4M3.decode(E4M3.quantize(y as f32, 1.0)) as f64;
                    (q - y) * (q - y) * h
                })
                .sum();
            let exact = grid.squared_error_integral(a, b);
            assert!(
                (numeric - exact).abs() <= 1e-6 * exact.max(1e-30),
                "[{a}, {b}]: {numeric} vs {exact}"
            );
        }
    }

    #[test]
    fn optimal_scale_beats_the_dynamic_scale() {
        let values = wide_values(20_000, 3);
        let mut s = Sketch::new(7);
        s.update_f32(&values);
        for format in FORMATS {
            let dynamic = range_fit(&s, &format, (format.max as f64 / s.amax()) as f32);
            let p2 = optimal_scale(&s, &format, true);
            let free = optimal_scale(&s, &format, false);
            assert!(p2.scale.log2().fract() == 0.0);
            assert!(free.predicted_rel_error <= p2.predicted_rel_error);
            assert!(free.predicted_rel_error <= dynamic.predicted_rel_error);
        }
    }

    #[test]
    fn nothing_saturates_at_the_dynamic_scale() {
        let values = wide_values(10_000, 9);
        let mut s = Sketch::new(7);
        s.update_f32(&values);
        for format in FORMATS {
            let scale = (format.max as f64 / s.amax()) as f32;
            let fit = range_fit(&s, &format, scale);
            let (sat, _, _, _) = brute_force(&values, &format, scale);
            assert_eq!(
                fit.saturated * s.finite() as f64,
                sat as f64,
                "{}",
                format.name
            );
        }
    }

    #[test]
    fn all_zero_and_empty_inputs() {
        let mut s = Sketch::new(7);
        assert!(range_fit(&s, &E4M3, 1.0).saturated.is_nan());
        s.update_f32(&[0.0; 10]);
        let fit = optimal_scale(&s, &E4M3, false);
        assert_eq!(
            (
                fit.scale,
                fit.saturated,
                fit.underflow,
                fit.predicted_rel_error
            ),
            (1.0, 0.0, 0.0, 0.0)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn pow2_fractions_are_exact_counts(
            values in proptest::collection::vec(prop_oneof![-1e6f32..1e6f32, -1e-3f32..1e-3f32, Just(448.0f32), Just(0.0f32)], 1..2000),
            k in -20i32..20,
            fmt in 0usize..2,
        ) {
            let format = FORMATS[fmt];
            let mut s = Sketch::new(7);
            s.update_f32(&values);
            let n = s.finite() as f64;
            let scale = 2f32.powi(k);
            let fit = range_fit(&s, &format, scale);
            let (sat, under, sub, _) = brute_force(&values, &format, scale);
            prop_assert!((fit.saturated * n - sat as f64).abs() < 1e-6);
            prop_assert!((fit.underflow * n - under as f64).abs() < 1e-6);
            prop_assert!((fit.subnormal * n - sub as f64).abs() < 1e-6);
        }
    }
}
