//! The store benchmark's raw-socket ceiling (`asyncflow_echo`), for `asyncflow.bench.echo`: a
//! server run in its own process, and a client that times pipelined round trips to it.

use std::net::{Shutdown, TcpStream};

use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::blocking::without_gil;

/// Listens on a free loopback port, passes the port to `on_listening`, then echoes each
/// connection in turn until the process ends.
#[pyfunction]
pub fn echo_serve(py: Python<'_>, on_listening: Bound<'_, PyAny>) -> PyResult<()> {
    let listener = asyncflow_echo::listen()?;
    on_listening.call1((listener.local_addr()?.port(),))?;
    without_gil(py, || asyncflow_echo::serve(&listener))?;
    Ok(())
}

/// A tuned connection to an echo server on loopback.
#[pyclass(module = "asyncflow._native", frozen)]
pub struct EchoClient {
    stream: TcpStream,
}

#[pymethods]
impl EchoClient {
    #[new]
    fn new(port: u16) -> PyResult<Self> {
        Ok(Self { stream: asyncflow_echo::connect(port)? })
    }

    /// Seconds to send `block` `rounds` times while reading each echo into `back` (same size
    /// as `block`; it ends holding the last round). Both arrays must be contiguous.
    fn round_trips(
        &self,
        py: Python<'_>,
        block: PyReadonlyArrayDyn<'_, u8>,
        rounds: usize,
        mut back: PyReadwriteArrayDyn<'_, u8>,
    ) -> PyResult<f64> {
        let block = block.as_slice()?;
        let back = back.as_slice_mut()?;
        if block.len() != back.len() {
            return Err(PyValueError::new_err(format!(
                "back holds {} bytes, the block {}",
                back.len(),
                block.len()
            )));
        }
        let stream = &self.stream;
        let elapsed = without_gil(py, || asyncflow_echo::round_trips(stream, block, rounds, back))?;
        Ok(elapsed.as_secs_f64())
    }

    /// Ends the connection; the server then takes the next one.
    fn close(&self) -> PyResult<()> {
        self.stream.shutdown(Shutdown::Both)?;
        Ok(())
    }
}
