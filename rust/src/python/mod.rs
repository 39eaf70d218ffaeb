//! The `loka.stats._native` extension module (re-exported by `loka.stats`).

mod arrays;
mod error_acc;
mod fp8;
mod sketch;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<sketch::PySketch>()?;
    m.add_class::<sketch::PyRangeFit>()?;
    m.add_class::<error_acc::PyErrorAccumulator>()?;
    m.add_class::<fp8::PyFp8Format>()?;
    m.add_function(wrap_pyfunction!(fp8::fp8_formats, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_roundtrip, m)?)?;
    m.add("FORMAT_VERSION", crate::codec::FORMAT_VERSION)?;
    Ok(())
}
