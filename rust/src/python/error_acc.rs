//! `loka.stats.ErrorAccumulator`.

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::arrays::{as_ndarray, check_contiguous, dtype_name, is, readonly};
use super::sketch::{decode, reduce_via_bytes, PySketch};
use crate::codec;
use crate::error_acc::ErrorAccumulator;

#[pyclass(module = "loka.stats", name = "ErrorAccumulator", from_py_object)]
#[derive(Clone)]
pub struct PyErrorAccumulator {
    inner: ErrorAccumulator,
}

/// Per-row quantiles reported by `summary()`.
const ROW_QUANTILES: [(&str, f64); 3] = [("row_p50", 0.5), ("row_p99", 0.99), ("row_max", 1.0)];

fn update_typed<T: numpy::Element + Copy + Into<f64> + Send + Sync>(
    py: Python<'_>,
    acc: &mut ErrorAccumulator,
    reference: &Bound<'_, PyUntypedArray>,
    approx: &Bound<'_, PyUntypedArray>,
    cols: Option<usize>,
) -> PyResult<()> {
    const CONTEXT: &str = "ErrorAccumulator.update";
    let r = readonly::<T>(reference, CONTEXT)?;
    let a = readonly::<T>(approx, CONTEXT)?;
    let (r, a) = (
        r.as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?,
        a.as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?,
    );
    py.detach(|| acc.update(r, a, cols))
        .map_err(|e| PyValueError::new_err(format!("{CONTEXT}: {e}")))
}

#[pymethods]
impl PyErrorAccumulator {
    #[new]
    fn new() -> Self {
        PyErrorAccumulator {
            inner: ErrorAccumulator::new(),
        }
    }

    /// Add one batch: same-shape float32 (or float64) arrays. Arrays of 2 or more
    /// dimensions are rows of their last dimension and also give per-row relative errors.
    fn update(
        &mut self,
        py: Python<'_>,
        reference: &Bound<'_, PyAny>,
        approx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        const CONTEXT: &str = "ErrorAccumulator.update";
        let r = as_ndarray(reference, CONTEXT)?;
        let a = as_ndarray(approx, CONTEXT)?;
        if r.shape() != a.shape() {
            return Err(PyValueError::new_err(format!(
                "{CONTEXT}: reference shape {:?} and approx shape {:?} differ",
                r.shape(),
                a.shape()
            )));
        }
        check_contiguous(r, CONTEXT, false)?;
        check_contiguous(a, CONTEXT, false)?;
        let cols = if r.ndim() >= 2 {
            Some(r.shape()[r.ndim() - 1])
        } else {
            None
        };
        if cols == Some(0) {
            return Err(PyValueError::new_err(format!(
                "{CONTEXT}: empty batch of shape {:?}",
                r.shape()
            )));
        }
        let acc = &mut self.inner;
        if is::<f32>(r) && is::<f32>(a) {
            update_typed::<f32>(py, acc, r, a, cols)
        } else if is::<f64>(r) && is::<f64>(a) {
            update_typed::<f64>(py, acc, r, a, cols)
        } else {
            Err(PyTypeError::new_err(format!(
                "{CONTEXT}: expected two float32 (or two float64) arrays, got dtypes {} and {}",
                dtype_name(r),
                dtype_name(a)
            )))
        }
    }

    #[getter]
    fn n_batches(&self) -> u64 {
        self.inner.n_batches()
    }
    #[getter]
    fn n_values(&self) -> u64 {
        self.inner.n_values()
    }
    /// 10 log10(sum ref^2 / sum (approx - ref)^2) over everything seen.
    #[getter]
    fn sqnr_db(&self) -> f64 {
        self.inner.sqnr_db()
    }
    /// ||approx - ref|| / ||ref|| over everything seen.
    #[getter]
    fn rel_fro(&self) -> f64 {
        self.inner.rel_fro()
    }
    #[getter]
    fn max_abs(&self) -> f64 {
        self.inner.max_abs()
    }
    /// Mean of the per-batch relative Frobenius errors.
    #[getter]
    fn batch_mean(&self) -> f64 {
        self.inner.batch_mean()
    }
    /// Sample variance (ddof=1) of the per-batch errors; NaN below two batches.
    #[getter]
    fn batch_var(&self) -> f64 {
        self.inner.batch_var()
    }
    #[getter]
    fn batch_std(&self) -> f64 {
        self.inner.batch_var().sqrt()
    }
    /// Sketch of the per-row relative errors (rows with a zero reference and a nonzero
    /// approximation are +inf).
    #[getter]
    fn row_errors(&self) -> PySketch {
        PySketch {
            inner: self.inner.row_errors().clone(),
        }
    }

    /// Quantile of the per-row relative errors (numpy 'linear'; infinite rows sort last).
    fn row_rel_err_quantile(&self, q: f64) -> PyResult<f64> {
        if !(0.0..=1.0).contains(&q) {
            return Err(PyValueError::new_err(format!(
                "quantile {q} is outside [0, 1]"
            )));
        }
        self.inner.row_rel_err_quantile(q).ok_or_else(|| {
            PyValueError::new_err(
                "no per-row errors yet: they come from batches of 2 or more dimensions",
            )
        })
    }

    /// Add another accumulator's batches in place (`acc.merge(acc)` counts them twice).
    fn merge(slf: &Bound<'_, Self>, other: &Bound<'_, Self>) {
        let other = other.borrow().inner.clone();
        slf.borrow_mut().inner.merge(&other);
    }

    #[staticmethod]
    fn merged(a: &PyErrorAccumulator, b: &PyErrorAccumulator) -> PyErrorAccumulator {
        let mut inner = a.inner.clone();
        inner.merge(&b.inner);
        PyErrorAccumulator { inner }
    }

    fn __add__(&self, other: &PyErrorAccumulator) -> PyErrorAccumulator {
        PyErrorAccumulator::merged(self, other)
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &codec::error_acc_to_bytes(&self.inner))
    }

    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<PyErrorAccumulator> {
        decode(
            data,
            "ErrorAccumulator.from_bytes",
            codec::error_acc_from_bytes,
        )
        .map(|inner| PyErrorAccumulator { inner })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce_via_bytes(slf.as_any(), slf.borrow().to_bytes(slf.py()))
    }

    /// A flat dict: batches, values, SQNR, errors, batch statistics, row-error quantiles.
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let a = &self.inner;
        let d = PyDict::new(py);
        d.set_item("n_batches", a.n_batches())?;
        d.set_item("n_values", a.n_values())?;
        d.set_item("sqnr_db", a.sqnr_db())?;
        d.set_item("rel_fro", a.rel_fro())?;
        d.set_item("max_abs", a.max_abs())?;
        d.set_item("batch_mean", a.batch_mean())?;
        d.set_item("batch_var", a.batch_var())?;
        d.set_item("batch_std", a.batch_var().sqrt())?;
        for (name, q) in ROW_QUANTILES {
            d.set_item(name, a.row_rel_err_quantile(q).unwrap_or(f64::NAN))?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let a = &self.inner;
        format!(
            "ErrorAccumulator(n_batches={}, rel_fro={:.4e}, sqnr_db={:.2}, max_abs={:.4e})",
            a.n_batches(),
            a.rel_fro(),
            a.sqnr_db(),
            a.max_abs()
        )
    }
}
