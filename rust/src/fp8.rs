//! FP8 formats and their CPU emulation.
//!
//! Quantization follows the project's convention: `q = saturate(x * scale)` cast to FP8 with
//! round-to-nearest-even, the product rounded to float32 first; this is bit-exact with
//! `torch.clamp(x * scale, -max, max).to(torch.float8_e4m3fn)` (and `float8_e5m2`), NaN
//! included (NaN keeps its sign and becomes the all-ones code). An infinite `x` is the
//! exception: it becomes the positive NaN code, as `loka.schema.fp8.saturate_cast` makes
//! it (an overflow upstream must not turn into a finite number); a finite `x` whose product
//! overflows saturates.

/// One FP8 encoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Format {
    /// The project's name for it: `"e4m3"` or `"e5m2"`.
    pub name: &'static str,
    pub exponent_bits: u32,
    pub mantissa_bits: u32,
    pub bias: i32,
    /// Largest finite magnitude.
    pub max: f32,
}

/// `torch.float8_e4m3fn`: finite-only (no infinities), NaN = S.1111.111.
pub const E4M3: Fp8Format = Fp8Format {
    name: "e4m3",
    exponent_bits: 4,
    mantissa_bits: 3,
    bias: 7,
    max: 448.0,
};

/// `torch.float8_e5m2`: IEEE-like, max 57344.
pub const E5M2: Fp8Format = Fp8Format {
    name: "e5m2",
    exponent_bits: 5,
    mantissa_bits: 2,
    bias: 15,
    max: 57344.0,
};

pub const FORMATS: [Fp8Format; 2] = [E4M3, E5M2];

impl Fp8Format {
    pub fn by_name(name: &str) -> Option<Fp8Format> {
        FORMATS.iter().copied().find(|f| f.name == name)
    }

    /// Smallest positive normal value, 2^(1 - bias).
    pub fn min_normal(&self) -> f32 {
        pow2_f32(1 - self.bias)
    }

    /// Smallest positive subnormal value, 2^(1 - bias - mantissa_bits).
    pub fn min_subnormal(&self) -> f32 {
        pow2_f32(1 - self.bias - self.mantissa_bits as i32)
    }

    /// The code of a quiet NaN with the given sign (what torch produces for a NaN input).
    fn nan_code(&self, negative: bool) -> u8 {
        0x7f | ((negative as u8) << 7)
    }

    /// FP8 bits of `x * scale` (both float32): saturating, round-to-nearest-even; an
    /// infinite `x` gives NaN.
    #[inline]
    pub fn quantize(&self, x: f32, scale: f32) -> u8 {
        if x.is_infinite() {
            return self.nan_code(false);
        }
        let y = x * scale;
        let bits = y.to_bits();
        let sign = ((bits >> 31) as u8) << 7;
        if y.is_nan() {
            return self.nan_code(sign != 0);
        }
        let a = y.abs().min(self.max);
        let m = self.mantissa_bits;
        if a < self.min_normal() {
            // Subnormal range: a / min_subnormal is an exact power-of-two rescaling, and the
            // integer it rounds to is the code (2^m rounds up into the first normal code).
            let steps = (a / self.min_subnormal()).round_ties_even() as u8;
            return sign | steps;
        }
        let a_bits = a.to_bits();
        let drop = 23 - m;
        let half_minus_one = (1u32 << (drop - 1)) - 1;
        let odd = (a_bits >> drop) & 1;
        let rounded = (a_bits + half_minus_one + odd) >> drop;
        // Rebias the exponent: float32 bias 127 -> the format's bias.
        let code = rounded - (((127 - self.bias) as u32) << m);
        sign | code as u8
    }

    /// The float32 value of FP8 bits (NaN codes give NaN).
    pub fn decode(&self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let magnitude_bits = (code & 0x7f) as u32;
        let m = self.mantissa_bits;
        let exp_field = magnitude_bits >> m;
        let mantissa = magnitude_bits & ((1 << m) - 1);
        let exp_max = (1u32 << self.exponent_bits) - 1;
        let is_nan = if self.name == "e4m3" {
            magnitude_bits == 0x7f
        } else {
            exp_field == exp_max && mantissa != 0
        };
        if is_nan {
            // The payload torch produces: the mantissa moved to the top, quiet bit set.
            let sign = (negative as u32) << 31;
            return f32::from_bits(sign | 0x7fc0_0000 | (mantissa << (23 - m)));
        }
        let value = if exp_field == exp_max && self.name != "e4m3" {
            f32::INFINITY
        } else if exp_field == 0 {
            mantissa as f32 * self.min_subnormal()
        } else {
            let exponent = exp_field as i32 - self.bias;
            (1.0 + mantissa as f32 / (1u32 << m) as f32) * pow2_f32(exponent)
        };
        if negative {
            -value
        } else {
            value
        }
    }

    /// All 256 decoded values, indexed by code.
    pub fn decode_table(&self) -> [f32; 256] {
        let mut table = [0.0f32; 256];
        for (code, slot) in table.iter_mut().enumerate() {
            *slot = self.decode(code as u8);
        }
        table
    }

    /// `quantize` then `dequantize`: the float32 value `x` turns into, `q / scale`.
    #[inline]
    pub fn roundtrip(&self, x: f32, scale: f32, table: &[f32; 256]) -> f32 {
        table[self.quantize(x, scale) as usize] / scale
    }
}

/// 2^e as float32 for e in the normal and subnormal range of float32.
pub fn pow2_f32(e: i32) -> f32 {
    pow2_f64(e) as f32
}

/// 2^e as float64, exact for -1074 <= e <= 1023.
pub fn pow2_f64(e: i32) -> f64 {
    if e >= -1022 {
        f64::from_bits(((e + 1023) as u64) << 52)
    } else {
        f64::from_bits(1u64 << (e + 1074))
    }
}

pub fn quantize_slice(format: &Fp8Format, xs: &[f32], scale: f32, out: &mut [u8]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = format.quantize(x, scale);
    }
}

pub fn dequantize_slice(format: &Fp8Format, codes: &[u8], scale: f32, out: &mut [f32]) {
    let table = format.decode_table();
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = table[c as usize] / scale;
    }
}

pub fn roundtrip_slice(format: &Fp8Format, xs: &[f32], scale: f32, out: &mut [f32]) {
    let table = format.decode_table();
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = format.roundtrip(x, scale, &table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round-to-nearest-even onto the FP8 grid by enumeration: the reference the bit
    /// manipulation in `quantize` must agree with.
    fn quantize_by_search(format: &Fp8Format, x: f32, scale: f32) -> u8 {
        let y = x * scale;
        if y.is_nan() {
            return format.quantize(y, 1.0);
        }
        let y = y.clamp(-format.max, format.max) as f64;
        let table = format.decode_table();
        let mut best: Option<(u8, f64)> = None;
        for code in 0u8..=255 {
            let v = table[code as usize] as f64;
            if !v.is_finite() || (v == 0.0 && code != 0 && code != 0x80) {
                continue;
            }
            if (v < 0.0 || (v == 0.0 && code == 0x80))
                != (y < 0.0 || (y == 0.0 && y.is_sign_negative()))
            {
                continue;
            }
            let d = (v - y).abs();
            best = match best {
                None => Some((code, d)),
                Some((bc, bd)) => {
                    // On a tie keep the code with an even mantissa (its lowest bit is 0).
                    if d < bd || (d == bd && code & 1 == 0 && bc & 1 == 1) {
                        Some((code, d))
                    } else {
                        Some((bc, bd))
                    }
                }
            };
        }
        best.unwrap().0
    }

    #[test]
    fn constants_match_the_formats() {
        assert_eq!(E4M3.max, 448.0);
        assert_eq!(E5M2.max, 57344.0);
        assert_eq!(E4M3.min_normal(), 2f32.powi(-6));
        assert_eq!(E4M3.min_subnormal(), 2f32.powi(-9));
        assert_eq!(E5M2.min_normal(), 2f32.powi(-14));
        assert_eq!(E5M2.min_subnormal(), 2f32.powi(-16));
        assert_eq!(E4M3.decode(0x7e), 448.0);
        assert_eq!(E5M2.decode(0x7b), 57344.0);
        assert!(E4M3.decode(0x7f).is_nan());
        assert_eq!(E5M2.decode(0x7c), f32::INFINITY);
    }

    #[test]
    fn every_code_roundtrips() {
        for format in FORMATS {
            for code in 0u8..=255 {
                let v = format.decode(code);
                if v.is_finite() {
                    assert_eq!(
                        format.quantize(v, 1.0),
                        code,
                        "{} code {code:#x}",
                        format.name
                    );
                }
            }
        }
    }

    #[test]
    fn ties_round_to_even_and_saturate() {
        // 1 + 1/16 lies halfway between 1 and 1 + 1/8 in e4m3: even mantissa (1.0) wins.
        assert_eq!(E4M3.decode(E4M3.quantize(1.0625, 1.0)), 1.0);
        assert_eq!(E4M3.decode(E4M3.quantize(1.1875, 1.0)), 1.25);
        // Half the smallest subnormal flushes to zero; a hair above rounds up.
        assert_eq!(E4M3.quantize(2f32.powi(-10), 1.0), 0);
        assert_eq!(E4M3.quantize(2f32.powi(-10) * 1.0001, 1.0), 1);
        assert_eq!(E4M3.quantize(1e9, 1.0), 0x7e);
        // A product that overflows saturates.
        assert_eq!(E4M3.quantize(3e38, 10.0), 0x7e);
        // An infinite input is an overflow upstream: NaN, whatever its sign.
        assert_eq!(E4M3.quantize(f32::NEG_INFINITY, 1.0), 0x7f);
        assert_eq!(E5M2.quantize(f32::INFINITY, 1.0), E5M2.nan_code(false));
        assert_eq!(E4M3.quantize(f32::NAN, 1.0), 0x7f);
        assert_eq!(E4M3.quantize(-0.0, 1.0), 0x80);
    }

    #[test]
    fn agrees_with_exhaustive_search_on_a_dense_sweep() {
        for format in FORMATS {
            let mut bits = 0x3000_0000u32; // about 4.7e-10: far below both formats' range
            while bits < 0x4800_0000 {
                // about 131072: above both maxima
                let x = f32::from_bits(bits);
                for x in [x, -x] {
                    assert_eq!(
                        format.quantize(x, 1.0),
                        quantize_by_search(&format, x, 1.0),
                        "{} x={x:e}",
                        format.name
                    );
                }
                bits += 0x1_0001; // strides across mantissas and exponents alike
            }
        }
    }

    #[test]
    fn scale_is_applied_in_float32() {
        let x = 1.0f32 / 3.0;
        let scale = 3.0f32;
        assert_eq!(E4M3.quantize(x, scale), E4M3.quantize(x * scale, 1.0));
    }
}
