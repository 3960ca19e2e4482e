//! Reading a safetensors file: tensors by name, with their shapes, and the `__metadata__` strings.

use crate::HfError;
use burn::tensor::TensorData;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A safetensors file read into memory, its header parsed once.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Vec<u8>,
    header_len: usize,
    header: Metadata,
}

impl SafetensorsFile {
    /// Reads and parses `path`.
    ///
    /// # Errors
    /// [`HfError::MissingFile`] when it does not exist, [`HfError::Io`] when it cannot be read,
    /// [`HfError::Safetensors`] when its header is malformed.
    pub fn open(path: impl AsRef<Path>, what: &'static str) -> Result<Self, HfError> {
        let path = path.as_ref().to_path_buf();
        if !path.is_file() {
            return Err(HfError::MissingFile { path, what });
        }
        let bytes = std::fs::read(&path).map_err(|source| HfError::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
        // Validates the whole layout (offsets inside the buffer, no overlaps) once.
        SafeTensors::deserialize(&bytes).map_err(|e| HfError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let (header_len, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| HfError::Safetensors {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            path,
            bytes,
            header_len,
            header,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.header.tensors().into_keys().collect();
        names.sort();
        names
    }

    /// The shape of tensor `name`, or `None` if the file does not hold it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.header.info(name).map(|info| info.shape.clone())
    }

    /// The `__metadata__` strings (empty if the file has none).
    pub fn metadata(&self) -> HashMap<String, String> {
        self.header.metadata().clone().unwrap_or_default()
    }

    /// `__metadata__[key]` parsed as a number.
    ///
    /// # Errors
    /// [`HfError::Metadata`] when the key is absent or its value does not parse.
    pub fn metadata_number<T: std::str::FromStr>(&self, key: &str) -> Result<T, HfError> {
        let meta = self.header.metadata().as_ref();
        let value = meta
            .and_then(|m| m.get(key))
            .ok_or_else(|| HfError::Metadata {
                key: key.to_string(),
                path: self.path.clone(),
                found: "missing".to_string(),
            })?;
        value.trim().parse().map_err(|_| HfError::Metadata {
            key: key.to_string(),
            path: self.path.clone(),
            found: format!("'{value}', not a number of the expected type"),
        })
    }

    fn raw(&self, name: &str, expected: Option<&[usize]>) -> Result<(Dtype, &[u8]), HfError> {
        let info = self
            .header
            .info(name)
            .ok_or_else(|| HfError::MissingTensor {
                name: name.to_string(),
                path: self.path.clone(),
                expected: expected.map(<[usize]>::to_vec).unwrap_or_default(),
            })?;
        if let Some(expected) = expected
            && info.shape != expected
        {
            return Err(HfError::ShapeMismatch {
                name: name.to_string(),
                path: self.path.clone(),
                expected: expected.to_vec(),
                found: info.shape.clone(),
            });
        }
        let start = 8 + self.header_len + info.data_offsets.0;
        let end = 8 + self.header_len + info.data_offsets.1;
        Ok((info.dtype, &self.bytes[start..end]))
    }

    /// Tensor `name` as `f32` data, converting F16, BF16 and F64; checks the shape when `expected`
    /// is given.
    ///
    /// # Errors
    /// [`HfError::MissingTensor`], [`HfError::ShapeMismatch`] (naming both shapes) or
    /// [`HfError::Dtype`] for a non-float tensor.
    pub fn float(&self, name: &str, expected: Option<&[usize]>) -> Result<TensorData, HfError> {
        let (dtype, bytes) = self.raw(name, expected)?;
        let shape = self.shape(name).expect("raw() found the tensor");
        let values: Vec<f32> = match dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("chunk of 4")))
                .collect(),
            Dtype::F64 => bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("chunk of 8")) as f32)
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(HfError::Dtype {
                    name: name.to_string(),
                    path: self.path.clone(),
                    dtype: format!("{other:?}"),
                    expected: "a float type (F32, F16, BF16, F64)",
                });
            }
        };
        Ok(TensorData::new(values, shape))
    }

    /// Tensor `name` as `i64` data (from I64 or I32).
    ///
    /// # Errors
    /// [`HfError::MissingTensor`] or [`HfError::Dtype`] for a non-integer tensor.
    pub fn int(&self, name: &str) -> Result<TensorData, HfError> {
        let (dtype, bytes) = self.raw(name, None)?;
        let shape = self.shape(name).expect("raw() found the tensor");
        let values: Vec<i64> = match dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("chunk of 8")))
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("chunk of 4"))))
                .collect(),
            other => {
                return Err(HfError::Dtype {
                    name: name.to_string(),
                    path: self.path.clone(),
                    dtype: format!("{other:?}"),
                    expected: "an integer type (I64, I32)",
                });
            }
        };
        Ok(TensorData::new(values, shape))
    }

    /// A float scalar (a tensor of shape `[]` or `[1]`).
    ///
    /// # Errors
    /// As [`Self::float`], and [`HfError::ShapeMismatch`] when it holds more than one value.
    pub fn scalar(&self, name: &str) -> Result<f32, HfError> {
        let data = self.float(name, None)?;
        let values = data.to_vec::<f32>().expect("float() returns f32 data");
        match values.as_slice() {
            [v] => Ok(*v),
            _ => Err(HfError::ShapeMismatch {
                name: name.to_string(),
                path: self.path.clone(),
                expected: vec![],
                found: data.shape.to_vec(),
            }),
        }
    }
}
