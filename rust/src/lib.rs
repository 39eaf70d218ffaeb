//! loka-stats: streaming statistics of sampled tensors.

#[cfg(feature = "python")]
mod python {
    use pyo3::prelude::*;

    #[pymodule]
    fn _native(_m: &Bound<'_, PyModule>) -> PyResult<()> {
        Ok(())
    }
}
