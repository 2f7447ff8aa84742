//! Minimal `.npy` (format 1.0) for 2-D float arrays: the engine writes logits as `<f4`; tests read the
//! references' `<f4`/`<f8` goldens.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Writes a C-order float32 array of shape [rows, cols] atomically (temp file + rename).
pub fn write_f32(path: &Path, rows: usize, cols: usize, data: &[f32]) -> Result<()> {
    assert_eq!(
        data.len(),
        rows * cols,
        "npy::write_f32 called with a mismatched shape"
    );
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for x in data {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    crate::write_atomically(path, &bytes)
}

/// A 2-D array read from `.npy`, widened to f64.
#[derive(Debug)]
pub struct Array2 {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f64>,
}

impl Array2 {
    pub fn row(&self, r: usize) -> &[f64] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Reads a little-endian, C-order `<f4` or `<f8` array of one or two dimensions (1-D reads as one row).
pub fn read(path: &Path) -> Result<Array2> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse(&bytes).with_context(|| format!("{} is not a float .npy array", path.display()))
}

/// Parses a whole `.npy` file's bytes (see [`read`]).
pub fn parse(bytes: &[u8]) -> Result<Array2> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        bail!("missing the .npy magic");
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            let b = bytes.get(8..12).context("truncated header")?;
            (u32::from_le_bytes(b.try_into()?) as usize, 12)
        }
        v => bail!("unsupported .npy version {v}"),
    };
    let header = std::str::from_utf8(
        bytes
            .get(hstart..hstart + hlen)
            .context("truncated header")?,
    )?;
    let width = if header.contains("'<f4'") {
        4
    } else if header.contains("'<f8'") {
        8
    } else {
        bail!("dtype must be '<f4' or '<f8'; header is {header}");
    };
    if header.contains("'fortran_order': True") {
        bail!("Fortran-order arrays are not supported");
    }
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .context("no shape in header")?;
    let dims: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().context("bad shape"))
        .collect::<Result<_>>()?;
    let (rows, cols) = match dims[..] {
        [n] => (1, n),
        [r, c] => (r, c),
        _ => bail!("expected a 1-D or 2-D array, shape is {dims:?}"),
    };
    let payload = &bytes[hstart + hlen..];
    let need = rows.checked_mul(cols).and_then(|n| n.checked_mul(width));
    if need != Some(payload.len()) {
        bail!(
            "payload is {} bytes, shape {dims:?} needs {}",
            payload.len(),
            need.map_or("more than fits in memory".into(), |n| n.to_string())
        );
    }
    let data = if width == 4 {
        payload
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect()
    } else {
        payload
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    Ok(Array2 { rows, cols, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_f32() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        write_f32(&p, 2, 3, &data).unwrap();
        let raw = std::fs::read(&p).unwrap();
        assert_eq!((raw.len() - 24) % 64, 0, "header padded to 64 bytes");
        let a = read(&p).unwrap();
        assert_eq!((a.rows, a.cols), (2, 3));
        assert_eq!(a.row(1), &[0.5, 1.0, 1.5]);
    }

    #[test]
    fn rejects_other_dtypes() {
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        let h = "{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }\n";
        bytes.extend_from_slice(&(h.len() as u16).to_le_bytes());
        bytes.extend_from_slice(h.as_bytes());
        bytes.extend_from_slice(&[0; 4]);
        assert!(format!("{:#}", parse(&bytes).unwrap_err()).contains("'<f4' or '<f8'"));
    }
}
