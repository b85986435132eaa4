//! Read-only memory maps of files: checkpoints are read where the page cache holds them, with no
//! copy of the whole file into the process.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

/// A file mapped read-only into memory, or read into memory where mapping is refused (some file
/// systems cannot map).
pub(crate) enum MappedFile {
    Mapped(Mmap),
    Read(Vec<u8>),
}

impl MappedFile {
    /// Maps `path` read-only.
    pub(crate) fn open(path: &Path) -> std::io::Result<MappedFile> {
        let file = File::open(path)?;
        if file.metadata()?.len() == 0 {
            // An empty file cannot be mapped; it is (invalidly) empty either way.
            return Ok(MappedFile::Read(Vec::new()));
        }
        // SAFETY: the map is read-only and private to this value; the bytes are only read as plain
        // bytes (validated by the safetensors parser before any use), so another process truncating
        // or rewriting the file can at worst make reads see other bytes or fault (SIGBUS) — the
        // documented hazard of every memory-mapped reader, as in safetensors' and candle's loaders.
        match unsafe { Mmap::map(&file) } {
            Ok(map) => Ok(MappedFile::Mapped(map)),
            Err(_) => Ok(MappedFile::Read(std::fs::read(path)?)),
        }
    }

    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            MappedFile::Mapped(map) => map,
            MappedFile::Read(bytes) => bytes,
        }
    }
}
