mod calibration;
mod parameters;
mod scheme;

pub use calibration::*;
pub use parameters::*;
pub use scheme::*;
