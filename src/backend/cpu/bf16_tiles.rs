//! Intel AMX for `bf16` products: eight tile registers of 16 rows × 64 bytes and `TDPBF16PS`,
//! which multiplies a 16 × 32 `bf16` tile by a 32 × 16 one (in `k` pairs) into 16 × 16 `f32` sums:
//! 8,192 multiply-adds an instruction, 16x what `vdpbf16ps` does on a 512-bit register.
//!
//! The unit of work is a 32 × 32 block of `f32` sums in four accumulator tiles (2 × 2), fed per
//! step of 32 `k` by two tiles of the left operand (rows contiguous along `k`, any row stride) and
//! two of the right (the `[pair][column]` panels of [`super::bf16_gemm`], 32 columns wide): four
//! tile loads for four products, the shape that keeps the unit busy from L1 and L2.
//!
//! Linux gives a process the tiles' 8 KiB of state only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`); a CPU that lists AMX in its flags but whose kernel or hypervisor refuses
//! the request faults with `SIGILL` on the first tile instruction. [`Amx::detect`] asks once and
//! says yes only when the CPU has the instructions and the request was granted.
//!
//! The instructions are written with `asm!`: Rust's AMX intrinsics and target features are not
//! stable. No code the compiler emits touches tile registers, so the configuration one
//! [`Tiles`] loads stays in place between its blocks.

use std::marker::PhantomData;

use crate::dtype::bf16;

/// Rows and columns of the block [`Tiles::block`] computes.
pub(super) const BLOCK: usize = 32;
/// `k` pairs per step: one tile row of 64 bytes holds 16 pairs of `bf16`.
pub(super) const STEP_PAIRS: usize = 16;

/// Proof that this CPU has AMX-TILE and AMX-BF16 and that the kernel granted this process the tile
/// state: only [`detect`](Self::detect) makes one.
#[derive(Clone, Copy, Debug)]
pub(super) struct Amx {
    _detected: (),
}

impl Amx {
    /// The proof, where this CPU and kernel run tiles (checked and requested once per process).
    pub(super) fn detect() -> Option<Amx> {
        (listed(AMX_BF16) && granted()).then_some(Amx { _detected: () })
    }
}

/// CPUID leaf 7's EDX bit of AMX-BF16 (`TDPBF16PS`).
const AMX_BF16: u32 = 1 << 22;
/// CPUID leaf 7's EDX bit of AMX-INT8 (`TDPBSSD` and its kin).
pub(super) const AMX_INT8: u32 = 1 << 25;

/// Whether CPUID lists AMX-TILE (leaf 7, sub-leaf 0, EDX bit 24) and `extension`.
#[cfg(target_arch = "x86_64")]
pub(super) fn listed(extension: u32) -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    const AMX_TILE: u32 = 1 << 24;
    let wanted = AMX_TILE | extension;
    __cpuid(0).eax >= 7 && __cpuid_count(7, 0).edx & wanted == wanted
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn listed(_extension: u32) -> bool {
    false
}

/// Whether Linux grants this process the tile data state (asked once per process; every AMX
/// extension's tiles are the same state).
pub(super) fn granted() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(request)
}

/// Asks Linux for the tile data state, where CPUID lists the tiles.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request() -> bool {
    /// `arch_prctl` request for permission to use an extended state component (Linux 5.16).
    const ARCH_REQ_XCOMP_PERM: libc::c_int = 0x1023;
    /// The extended state component of AMX's tile data.
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: `arch_prctl` with this request reads its two integer arguments and changes only the
    // process's permitted extended state; it touches no memory of ours.
    listed(0)
        && unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        } == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request() -> bool {
    false
}

/// The tile configuration every block uses (palette 1): tiles 0-7 all 16 rows of 64 bytes. The
/// layout `LDTILECFG` reads: 64 bytes, the palette, the start row, 14 reserved bytes, each tile's
/// bytes per row (`u16`), each tile's rows.
#[repr(C, align(64))]
pub(super) struct Config {
    pub(super) palette: u8,
    pub(super) start_row: u8,
    pub(super) reserved: [u8; 14],
    pub(super) bytes_per_row: [u16; 16],
    pub(super) rows: [u8; 16],
}

const CONFIG: Config = Config {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// This thread's tiles, configured by one [`Config`] until dropped (which releases them, so the
/// thread's state is small again at the next context switch): what every user of the tiles holds
/// ([`Tiles`], the int8 tiles). Not `Send`: the configuration belongs to the thread that loaded it.
pub(super) struct Configured {
    _thread: PhantomData<*const ()>,
}

impl Configured {
    /// Loads `config` into this thread's tile configuration.
    ///
    /// # Safety
    /// The CPU must have AMX-TILE and Linux must have granted this process the tile state (an
    /// [`Amx`] or an `AmxInt8` says so); `config` must be a valid palette-1 configuration.
    pub(super) unsafe fn load(config: &'static Config) -> Configured {
        let _ = config;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract; `LDTILECFG` reads the 64 bytes of `config`.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly));
        }
        Configured {
            _thread: PhantomData,
        }
    }
}

impl Drop for Configured {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `TILERELEASE` returns the tiles to their initial state; nothing of ours reads
        // them afterwards (a new `Configured` loads a configuration again).
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// Checks that a block's operands hold what [`Tiles::block_into`] reads and writes (every unit of
/// blocks has this contract).
///
/// # Panics
/// When a slice is too short for the rows and steps it is read or written at.
pub(super) fn check_block(
    (left, left_stride): (&[bf16], usize),
    right: &[u32],
    steps: usize,
    (sums, sums_stride): (&[f32], usize),
) {
    let depth = steps * 2 * STEP_PAIRS;
    assert!(
        steps > 0
            && left_stride >= depth
            && left.len() >= (BLOCK - 1) * left_stride + depth
            && right.len() >= steps * STEP_PAIRS * BLOCK
            && sums_stride >= BLOCK
            && sums.len() >= (BLOCK - 1) * sums_stride + BLOCK,
        "bf16 blocks: operands too short for a block"
    );
}

/// This thread's tiles, configured for [`block`](Self::block) until dropped. Not `Send`.
pub(super) struct Tiles {
    _configured: Configured,
}

impl Tiles {
    /// Configures this thread's tiles.
    pub(super) fn configure(amx: Amx) -> Tiles {
        let _ = amx;
        Tiles {
            // SAFETY: `amx` exists, so the CPU has AMX-TILE and the kernel granted the tile state;
            // `CONFIG` is a valid palette-1 configuration.
            _configured: unsafe { Configured::load(&CONFIG) },
        }
    }

    /// `sums = left · right` (or `sums += left · right`, with `accumulate`) over `steps` steps of
    /// [`STEP_PAIRS`] pairs: `left` is 32 rows of
    /// `bf16` starting `left_stride` elements apart (row `r`, element `i` at `left[r · left_stride
    /// + i]`, `i < 32 · steps`); `right` is `[pair][column]`, 32 `u32` per pair (the two `bf16` of
    /// column `c` at pair `p`: `right[32 p + c]`, the low half multiplying the even `k`).
    ///
    /// # Panics
    /// When a slice is too short for the rows and steps it is read at.
    pub(super) fn block(
        &mut self,
        left: &[bf16],
        left_stride: usize,
        right: &[u32],
        steps: usize,
        accumulate: bool,
        sums: &mut [[f32; BLOCK]; BLOCK],
    ) {
        self.block_into(
            (left, left_stride),
            right,
            steps,
            accumulate,
            (sums.as_flattened_mut(), BLOCK),
        );
    }

    /// [`block`](Self::block) with the 32 × 32 sums in rows `sums_stride` apart (row `r`, column
    /// `c` at `sums[r · sums_stride + c]`): a block of a wider matrix of sums, such as a row of
    /// attention scores.
    ///
    /// # Panics
    /// When a slice is too short for the rows and steps it is read or written at.
    pub(super) fn block_into(
        &mut self,
        (left, left_stride): (&[bf16], usize),
        right: &[u32],
        steps: usize,
        accumulate: bool,
        (sums, sums_stride): (&mut [f32], usize),
    ) {
        check_block((left, left_stride), right, steps, (sums, sums_stride));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Tiles` exists only after `LDTILECFG` configured tiles 0-7 as 16 rows of 64
        // bytes on this thread (it is not `Send`). The loads read, per step, rows `r < 32` of
        // `left` at `r · left_stride`, 64 bytes each (32 bf16 of the step; the assertion keeps the
        // last row's last step inside), and 16 rows of 128 bytes' stride of `right` at 64-byte
        // offsets 0 and 64 (the step's 16 pairs of 32 columns: inside by the assertion). The
        // stores write the four 16 × 16 accumulators into rows `r < 32` of `sums`, 128 bytes at
        // `r · sums_stride` (inside by the assertion), and with `accumulate` first load them from
        // there. The loop runs `steps >= 1` times.
        unsafe {
            std::arch::asm!(
                "test {acc:e}, {acc:e}",
                "jz 3f",
                "tileloadd tmm0, [{c} + {sc}*1]",
                "tileloadd tmm1, [{c} + {sc}*1 + 64]",
                "tileloadd tmm2, [{c1} + {sc}*1]",
                "tileloadd tmm3, [{c1} + {sc}*1 + 64]",
                "jmp 2f",
                "3:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b}, 2048",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {sc}*1], tmm0",
                "tilestored [{c} + {sc}*1 + 64], tmm1",
                "tilestored [{c1} + {sc}*1], tmm2",
                "tilestored [{c1} + {sc}*1 + 64], tmm3",
                a0 = inout(reg) left.as_ptr() => _,
                a1 = inout(reg) left.as_ptr().add(16 * left_stride) => _,
                sa = in(reg) left_stride * 2,
                b = inout(reg) right.as_ptr() => _,
                sb = in(reg) BLOCK * 4,
                n = inout(reg) steps => _,
                c = in(reg) sums.as_mut_ptr(),
                c1 = in(reg) sums.as_mut_ptr().add(16 * sums_stride),
                sc = in(reg) sums_stride * 4,
                acc = in(reg) u32::from(accumulate),
                options(nostack),
            );
        }
    }
}
