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
        // SAFETY: the map is read-only (`MAP_SHARED`, `PROT_READ`) and owned by this value; the bytes
        // are only read as plain bytes (validated by the safetensors parser before any use), so
        // another process truncating or rewriting the file in place can at worst make reads see
        // other bytes or fault (SIGBUS) — the hazard of every memory-mapped reader, stated to users
        // on `Weights::open` (which offers `Weights::read` for files that may change). ndscope's own
        // saves replace a file by renaming a new one over it, which leaves this map's pages alone.
        match unsafe { Mmap::map(&file) } {
            Ok(map) => Ok(MappedFile::Mapped(map)),
            Err(_) => Ok(MappedFile::Read(std::fs::read(path)?)),
        }
    }

    /// Tells the kernel that `range` of the file was read and is not needed again soon: its pages
    /// leave this process's resident set (they stay in the page cache, and a later read maps them
    /// again). Loading a checkpoint thus holds each tensor twice only while it is copied. Advice
    /// only: nothing happens where it is not supported.
    pub(crate) fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let MappedFile::Mapped(map) = self {
            // Rounded out to 2 MiB: a fault on a transparent huge page of the file maps all of it,
            // neighbours' bytes included, so releasing only the range would leave those mapped
            // (measured: 48 MB of GPT-2 small's 475 MB stayed resident). Pages of a neighbour not
            // yet read are simply read again. 2 MiB is a multiple of every base page size.
            const HUGE: usize = 2 << 20;
            let start = range.start / HUGE * HUGE;
            let end = range.end.next_multiple_of(HUGE).min(map.len());
            if end > start {
                // SAFETY: the map is a read-only mapping of a file, never written through, so
                // MADV_DONTNEED discards no data: the next read of these pages maps the file again.
                // No slice of the map is borrowed while this runs (`&self` is only lent out for
                // the copies that `bytes` serves, which have ended when a loader releases them).
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            MappedFile::Mapped(map) => map,
            MappedFile::Read(bytes) => bytes,
        }
    }
}
