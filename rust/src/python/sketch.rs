//! `loka.stats.Sketch` and `loka.stats.RangeFit`.

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyTuple};

use super::arrays::{as_unsigned, read_values, Values};
use super::fp8::{format_and_scale, format_by_name};
use crate::codec;
use crate::histogram::{MAX_MANTISSA_BITS, MIN_MANTISSA_BITS};
use crate::range_fit::{self, RangeFit};
use crate::sketch::Sketch;

/// Quantiles reported by `summary()`, with their keys.
pub const SUMMARY_QUANTILES: [(&str, f64); 5] = [
    ("p50", 0.5),
    ("p90", 0.9),
    ("p99", 0.99),
    ("p999", 0.999),
    ("p9999", 0.9999),
];

#[pyclass(module = "loka.stats", name = "Sketch", from_py_object)]
#[derive(Clone)]
pub struct PySketch {
    pub inner: Sketch,
}

/// The contents of a `bytes` or `bytearray`.
pub fn bytes_of(data: &Bound<'_, PyAny>, context: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = data.cast::<PyBytes>() {
        Ok(b.as_bytes().to_vec())
    } else if let Ok(b) = data.cast::<PyByteArray>() {
        Ok(b.to_vec())
    } else {
        Err(PyTypeError::new_err(format!(
            "{context}: expected bytes or bytearray"
        )))
    }
}

fn check_quantile(q: f64) -> PyResult<()> {
    if (0.0..=1.0).contains(&q) {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "quantile {q} is outside [0, 1]"
        )))
    }
}

/// Decode serialized bytes, turning any failure into a ValueError.
pub fn decode<T>(
    data: &Bound<'_, PyAny>,
    context: &str,
    decode: fn(&[u8]) -> Result<T, String>,
) -> PyResult<T> {
    let bytes = bytes_of(data, context)?;
    decode(&bytes).map_err(|e| PyValueError::new_err(format!("{context}: {e}")))
}

/// `(type(obj).from_bytes, (bytes,))`: pickling through the versioned byte format.
pub fn reduce_via_bytes<'py>(
    obj: &Bound<'py, PyAny>,
    bytes: Bound<'py, PyBytes>,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = obj.py();
    let from_bytes = obj.get_type().getattr("from_bytes")?;
    PyTuple::new(py, [from_bytes, PyTuple::new(py, [bytes])?.into_any()])
}

impl PySketch {
    fn wrap(inner: Sketch) -> Self {
        PySketch { inner }
    }

    fn sub(&self, pick: fn(&crate::sketch::RowSketches) -> &Sketch) -> Option<PySketch> {
        self.inner.rows().map(|r| PySketch::wrap(pick(r).clone()))
    }
}

#[pymethods]
impl PySketch {
    #[new]
    #[pyo3(signature = (mantissa_bits = 7))]
    fn new(mantissa_bits: i64) -> PyResult<Self> {
        let range = MIN_MANTISSA_BITS as i64..=MAX_MANTISSA_BITS as i64;
        if !range.contains(&mantissa_bits) {
            return Err(PyValueError::new_err(format!(
                "mantissa_bits must be in [{MIN_MANTISSA_BITS}, {MAX_MANTISSA_BITS}], got {mantissa_bits}"
            )));
        }
        Ok(PySketch::wrap(Sketch::new(mantissa_bits as u32)))
    }

    /// Add the values of an array of any shape (float32, float16, or bfloat16 bit patterns
    /// as uint16/int16 with `bf16=True`). The GIL is released while counting.
    #[pyo3(signature = (x, *, bf16 = false))]
    fn update(&mut self, py: Python<'_>, x: &Bound<'_, PyAny>, bf16: bool) -> PyResult<()> {
        let sketch = &mut self.inner;
        match read_values(x, bf16, "Sketch.update", true)? {
            Values::F32(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_f32(v));
            }
            Values::F16(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_f16(v));
            }
            Values::Bf16(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_bf16(v));
            }
            Values::Bf16Signed(a) => {
                let v = as_unsigned(slice(&a)?);
                py.detach(|| sketch.update_bf16(v));
            }
        }
        Ok(())
    }

    /// Add a 2-D `[rows, cols]` array: its values, plus the distributions of per-row and
    /// per-(1 x block) amax and of values normalized by them.
    #[pyo3(signature = (x, block = 128, *, bf16 = false))]
    fn update_rows(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        block: i64,
        bf16: bool,
    ) -> PyResult<()> {
        const CONTEXT: &str = "Sketch.update_rows";
        let array = super::arrays::as_ndarray(x, CONTEXT)?;
        if array.ndim() != 2 {
            return Err(PyValueError::new_err(format!(
                "{CONTEXT}: expected a 2-D [rows, cols] array, got {}-D shape {:?}",
                array.ndim(),
                array.shape()
            )));
        }
        if block < 1 {
            return Err(PyValueError::new_err(format!(
                "{CONTEXT}: block must be at least 1, got {block}"
            )));
        }
        let cols = array.shape()[1];
        let block = block as usize;
        let sketch = &mut self.inner;
        let result = match read_values(x, bf16, CONTEXT, false)? {
            Values::F32(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_rows_f32(v, cols, block))
            }
            Values::F16(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_rows_f16(v, cols, block))
            }
            Values::Bf16(a) => {
                let v = slice(&a)?;
                py.detach(|| sketch.update_rows_bf16(v, cols, block))
            }
            Values::Bf16Signed(a) => {
                let v = as_unsigned(slice(&a)?);
                py.detach(|| sketch.update_rows_bf16(v, cols, block))
            }
        };
        result.map_err(|e| PyValueError::new_err(format!("{CONTEXT}: {e}")))
    }

    /// Number of values seen, NaN and infinities included.
    #[getter]
    fn count(&self) -> u64 {
        self.inner.count()
    }
    /// Number of finite values (the denominator of quantiles and range-fit fractions).
    #[getter]
    fn finite(&self) -> u64 {
        self.inner.finite()
    }
    #[getter]
    fn zeros(&self) -> u64 {
        self.inner.zeros()
    }
    /// Values subnormal in the format they arrived in (float32/bfloat16: below 2^-126,
    /// float16: below 2^-14).
    #[getter]
    fn subnormals(&self) -> u64 {
        self.inner.subnormals()
    }
    #[getter]
    fn nan(&self) -> u64 {
        self.inner.nan()
    }
    #[getter]
    fn pos_inf(&self) -> u64 {
        self.inner.pos_inf()
    }
    #[getter]
    fn neg_inf(&self) -> u64 {
        self.inner.neg_inf()
    }
    #[getter]
    fn min(&self) -> f64 {
        self.inner.min()
    }
    #[getter]
    fn max(&self) -> f64 {
        self.inner.max()
    }
    #[getter]
    fn amax(&self) -> f64 {
        self.inner.amax()
    }
    #[getter]
    fn sum(&self) -> f64 {
        self.inner.sum()
    }
    #[getter]
    fn sum_sq(&self) -> f64 {
        self.inner.sum_sq()
    }
    #[getter]
    fn mean(&self) -> f64 {
        self.inner.mean()
    }
    #[getter]
    fn rms(&self) -> f64 {
        self.inner.rms()
    }
    #[getter]
    fn mantissa_bits(&self) -> u32 {
        self.inner.mantissa_bits()
    }
    /// Bound on the relative error of every quantile: 2^-(mantissa_bits + 1).
    #[getter]
    fn relative_error(&self) -> f64 {
        self.inner.relative_error()
    }
    /// Tile width of the block distributions (None until `update_rows`).
    #[getter]
    fn block(&self) -> Option<u32> {
        self.inner.rows().map(|r| r.block)
    }
    #[getter]
    fn row_amax(&self) -> Option<PySketch> {
        self.sub(|r| &r.row_amax)
    }
    #[getter]
    fn block_amax(&self) -> Option<PySketch> {
        self.sub(|r| &r.block_amax)
    }
    #[getter]
    fn row_normalized(&self) -> Option<PySketch> {
        self.sub(|r| &r.row_normalized)
    }
    #[getter]
    fn block_normalized(&self) -> Option<PySketch> {
        self.sub(|r| &r.block_normalized)
    }

    /// Quantile of |x| over the finite values (numpy's 'linear' definition).
    fn quantile(&self, q: f64) -> PyResult<f64> {
        Ok(self.quantiles(vec![q])?[0])
    }

    fn quantiles(&self, qs: Vec<f64>) -> PyResult<Vec<f64>> {
        for &q in &qs {
            check_quantile(q)?;
        }
        self.inner.quantiles(&qs).ok_or_else(|| {
            PyValueError::new_err("the sketch holds no finite values: quantiles are undefined")
        })
    }

    /// `{binary exponent e: count of finite values with 2^e <= |x| < 2^(e+1)}`; zeros are
    /// counted in `zeros`, not here.
    fn exponent_histogram<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (e, c) in self.inner.exponent_histogram() {
            d.set_item(e, c)?;
        }
        Ok(d)
    }

    /// The FP8 range fit at `scale` (x is quantized as `saturate(x * scale)`).
    fn range_fit(&self, format: &str, scale: f64) -> PyResult<PyRangeFit> {
        let (f, s) = format_and_scale(format, scale, "Sketch.range_fit")?;
        Ok(PyRangeFit::from(range_fit::range_fit(&self.inner, &f, s)))
    }

    /// `(scale, RangeFit)` minimizing the predicted relative error; `pow2` restricts the
    /// scale to powers of two.
    #[pyo3(signature = (format, pow2 = false))]
    fn optimal_scale(
        &self,
        py: Python<'_>,
        format: &str,
        pow2: bool,
    ) -> PyResult<(f64, PyRangeFit)> {
        let f = format_by_name(format)?;
        let sketch = &self.inner;
        let fit = py.detach(|| range_fit::optimal_scale(sketch, &f, pow2));
        Ok((fit.scale as f64, PyRangeFit::from(fit)))
    }

    /// Add another sketch's contents in place (exact for counts and the histogram).
    fn merge(slf: &Bound<'_, Self>, other: &Bound<'_, Self>) -> PyResult<()> {
        // `s.merge(s)` is legitimate: copy first rather than borrow one object twice.
        let other = other.borrow().inner.clone();
        slf.borrow_mut()
            .inner
            .merge(&other)
            .map_err(|e| PyValueError::new_err(format!("Sketch.merge: {e}")))
    }

    /// A new sketch holding both.
    #[staticmethod]
    fn merged(a: &PySketch, b: &PySketch) -> PyResult<PySketch> {
        let mut out = a.inner.clone();
        out.merge(&b.inner)
            .map_err(|e| PyValueError::new_err(format!("Sketch.merged: {e}")))?;
        Ok(PySketch::wrap(out))
    }

    fn __add__(&self, other: &PySketch) -> PyResult<PySketch> {
        PySketch::merged(self, other)
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &codec::sketch_to_bytes(&self.inner))
    }

    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<PySketch> {
        decode(data, "Sketch.from_bytes", codec::sketch_from_bytes).map(PySketch::wrap)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce_via_bytes(slf.as_any(), slf.borrow().to_bytes(slf.py()))
    }

    /// A flat dict of the statistics, for tables.
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        let d = PyDict::new(py);
        d.set_item("count", s.count())?;
        d.set_item("finite", s.finite())?;
        d.set_item("zeros", s.zeros())?;
        d.set_item("subnormals", s.subnormals())?;
        d.set_item("nan", s.nan())?;
        d.set_item("pos_inf", s.pos_inf())?;
        d.set_item("neg_inf", s.neg_inf())?;
        d.set_item("min", s.min())?;
        d.set_item("max", s.max())?;
        d.set_item("amax", s.amax())?;
        d.set_item("mean", s.mean())?;
        d.set_item("rms", s.rms())?;
        let qs: Vec<f64> = SUMMARY_QUANTILES.iter().map(|(_, q)| *q).collect();
        let values = s.quantiles(&qs).unwrap_or_else(|| vec![f64::NAN; qs.len()]);
        for ((name, _), v) in SUMMARY_QUANTILES.iter().zip(values) {
            d.set_item(*name, v)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "Sketch(count={}, finite={}, zeros={}, nan={}, inf={}, amax={}, rms={}, mantissa_bits={}{})",
            s.count(),
            s.finite(),
            s.zeros(),
            s.nan(),
            s.pos_inf() + s.neg_inf(),
            s.amax(),
            s.rms(),
            s.mantissa_bits(),
            s.rows().map(|r| format!(", block={}", r.block)).unwrap_or_default()
        )
    }
}

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|e| PyValueError::new_err(format!("array is not contiguous: {e}")))
}

/// How a distribution fits an FP8 format at one scale.
#[pyclass(module = "loka.stats", name = "RangeFit", frozen, get_all)]
#[derive(Clone)]
pub struct PyRangeFit {
    /// `"e4m3"` or `"e5m2"`.
    format: String,
    scale: f64,
    /// Fraction of finite values with |x * scale| > max (clipped).
    saturated: f64,
    /// Fraction of finite values that are nonzero but quantize to zero.
    underflow: f64,
    /// Fraction of finite values that quantize to a nonzero subnormal.
    subnormal: f64,
    /// Predicted ||dequant(quant(x)) - x|| / ||x|| (Frobenius).
    predicted_rel_error: f64,
}

/// `RangeFit(...)` constructor arguments, for pickling.
type RangeFitArgs = (String, f64, f64, f64, f64, f64);

impl From<RangeFit> for PyRangeFit {
    fn from(f: RangeFit) -> Self {
        PyRangeFit::new(
            f.format.name.to_string(),
            f.scale as f64,
            f.saturated,
            f.underflow,
            f.subnormal,
            f.predicted_rel_error,
        )
    }
}

#[pymethods]
impl PyRangeFit {
    #[new]
    fn new(
        format: String,
        scale: f64,
        saturated: f64,
        underflow: f64,
        subnormal: f64,
        predicted_rel_error: f64,
    ) -> Self {
        PyRangeFit {
            format,
            scale,
            saturated,
            underflow,
            subnormal,
            predicted_rel_error,
        }
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("format", &self.format)?;
        d.set_item("scale", self.scale)?;
        d.set_item("saturated", self.saturated)?;
        d.set_item("underflow", self.underflow)?;
        d.set_item("subnormal", self.subnormal)?;
        d.set_item("predicted_rel_error", self.predicted_rel_error)?;
        Ok(d)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, RangeFitArgs)> {
        let f = slf.get();
        Ok((
            slf.get_type().into_any(),
            (
                f.format.clone(),
                f.scale,
                f.saturated,
                f.underflow,
                f.subnormal,
                f.predicted_rel_error,
            ),
        ))
    }

    fn __repr__(&self) -> String {
        format!(
            "RangeFit(format='{}', scale={}, saturated={:.3e}, underflow={:.3e}, subnormal={:.3e}, predicted_rel_error={:.4e})",
            self.format, self.scale, self.saturated, self.underflow, self.subnormal, self.predicted_rel_error
        )
    }
}
