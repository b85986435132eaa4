//! A second order for the blocks of a quantized matrix: *strips* of 16 rows whose blocks are
//! interleaved, so that one 64-byte load holds 4 levels of each of the 16 rows. A CPU whose product
//! kernel keeps one row per 32-bit lane (AVX-512 VNNI: `vpdpbusd` sums 4 byte products per lane;
//! AVX2: `vpmaddubsw` and `vpmaddwd`, 8 rows per register) then reads its weights in the order it
//! multiplies them, with no decoding step per call and one
//! scale step per block for 16 rows; llama.cpp repacks its Q4_0 weights the same way on load for
//! the same reason.
//!
//! A strip block codes one block of each of the 16 rows. For Q4_0 and Q8_0 it is the same bytes
//! rearranged (16 stored blocks), so a matrix in strips is as large as in rows; Q4_K's 6-bit
//! sub-block scales and minimums are unpacked to a byte each (148 bytes per row and 256 values
//! against 144: 2.8 % more). Rows past the last whole strip (`rows % 16`) stay in row order after
//! the strips.
//!
//! *Nibble groups* (Q4_0's and Q4_K's levels): 32 values of 16 rows in four groups of 64 bytes;
//! in group `c`, row `r`'s 4 bytes at `4r` hold, in byte `j`, the level of value `8c + j` in the
//! low nibble and of value `8c + 4 + j` in the high nibble. One strip block, in order:
//!
//! *Fifth bits* (Q5_0's, Q5_1's and Q5_K's levels, 0..=31): the nibble groups of the low 4 bits,
//! then 64 bytes in which row `r`'s byte `4r + j` holds at bit `g` the fifth bit of value `4g + j`
//! (the value that nibble group order puts in byte `4r + j` of the `g`-th 4 values).
//!
//! - Q4_0 (32 values): the 16 rows' `f16` scales, row 0 first (32 bytes); the levels as nibble
//!   groups (the stored nibble `q`, 0..=15, value `d · (q − 8)`): 288 bytes. Q4_1: the scales,
//!   the rows' `f16` minimums (32 bytes), the nibble groups (value `d · q + m`): 320 bytes. Q5_0
//!   and Q5_1: Q4_0's and Q4_1's, then the fifth bits (value `d · (q − 16)`, `d · q + m`): 352 and
//!   384 bytes. All four are their stored blocks' own size.
//! - Q8_0 (32 values): the scales (32 bytes); eight groups of 64 bytes, in group `g` row `r`'s byte
//!   `j` the level of value `4g + j` plus 128 (unsigned, value `d · (u − 128)`): 544 bytes.
//! - Q4_K (256 values): the rows' `d` (32 bytes), their `dmin` (32 bytes), the 8 sub-blocks'
//!   scales as bytes, sub-block-major (`[8][16]`, 128 bytes), their minimums likewise (128
//!   bytes), then each sub-block's 32 levels as nibble groups (8 × 256 bytes): 2,368 bytes. Q5_K
//!   likewise, each sub-block's nibble groups followed by its fifth bits (8 × 320 bytes): 2,880
//!   bytes, 180 per row against 176 stored.
//! - Q6_K (256 values): the rows' `d` (32 bytes), the 16 sub-blocks' `i8` scales, sub-block-major
//!   (`[16][16]`, 256 bytes), then per 32 values the low 4 bits of the 6-bit levels as nibble
//!   groups (256 bytes) and their high 2 bits (128 bytes: in half `h`, row `r`'s byte `j` at
//!   `64h + 4r + j` holds at bits `2i` the high bits of value `4 · (4h + i) + j`): 3,360 bytes, the
//!   stored blocks' own size (level `q`, 0..=63, value `(d · sc) · (q − 32)`).

use super::QuantType;

/// Rows per strip.
pub(crate) const STRIP_ROWS: usize = 16;

/// Whether `ty` has a strip order.
pub(crate) fn has_strips(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
    )
}

/// Where a strip block of a 32-value nibble format (Q4_0, Q4_1, Q5_0, Q5_1) keeps its minimums
/// (the `_1` formats), its nibble groups and its fifth bits (the `Q5` formats), after the 32 bytes
/// of scales.
pub(crate) const fn small_strip(minimum: bool, fifth: bool) -> (usize, usize, usize, usize) {
    let nibbles = if minimum { 64 } else { 32 };
    let bytes = nibbles + 256 + if fifth { 64 } else { 0 };
    (32, nibbles, nibbles + 256, bytes)
}

/// The stride of a Q4_K (`fifth` false) or Q5_K strip block's sub-blocks, from byte 320.
pub(crate) const fn k4_sub_block(fifth: bool) -> usize {
    if fifth { 320 } else { 256 }
}

/// Bytes of one strip block (one block of each of 16 rows).
pub(crate) fn strip_block_bytes(ty: QuantType) -> usize {
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 => {
            small_strip(ty.has_minimum(), ty.has_fifth_bit()).3
        }
        QuantType::Q8_0 => 32 + 512,
        QuantType::Q4_K => 64 + 256 + 8 * k4_sub_block(false),
        QuantType::Q5_K => 64 + 256 + 8 * k4_sub_block(true),
        QuantType::Q6_K => 32 + 256 + 8 * 384,
        _ => unreachable!("{ty} has no strip order"),
    }
}

/// Bytes of a `rows × cols` matrix of `ty` in strips (`None` for a type without strips or a row
/// length that is not whole blocks).
pub(crate) fn strips_len(ty: QuantType, rows: usize, cols: usize) -> Option<usize> {
    if !has_strips(ty) {
        return None;
    }
    let row_bytes = ty.bytes_for(cols)?;
    let strips = (rows / STRIP_ROWS)
        .checked_mul(cols / ty.block_size())?
        .checked_mul(strip_block_bytes(ty))?;
    strips.checked_add((rows % STRIP_ROWS).checked_mul(row_bytes)?)
}

/// `bytes` (`rows` stored rows of `cols` values of `ty`) rearranged into strips.
///
/// # Panics
/// When `ty` has no strip order or `bytes` is not `rows` rows of `cols` values (caller bugs).
#[cfg(test)]
pub(crate) fn to_strips(ty: QuantType, bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; strips_len(ty, rows, cols).expect("a type with strips")];
    to_strips_into(ty, bytes, rows, cols, &mut out);
    out
}

/// `bytes` (`rows` stored rows of `cols` values of `ty`) rearranged into strips in `out` (its [`strips_len`]), a strip per rayon task: a model's load
/// arranges every matrix once, hundreds of megabytes.
///
/// # Panics
/// When `ty` has no strip order, `bytes` is not `rows` rows of `cols` values or `out` not their
/// strips' length (caller bugs).
pub(crate) fn to_strips_into(
    ty: QuantType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [u8],
) {
    let row_bytes = ty.bytes_for(cols).expect("whole blocks per row");
    assert!(
        has_strips(ty)
            && bytes.len() == rows * row_bytes
            && Some(out.len()) == strips_len(ty, rows, cols),
        "strips: {} bytes are not {rows} rows of {cols} {ty} values",
        bytes.len()
    );
    let whole = rows / STRIP_ROWS * STRIP_ROWS;
    let (strips, tail) = out.split_at_mut(out.len() - (rows - whole) * row_bytes);
    let (rows_in, shape) = (&bytes[..whole * row_bytes], (ty, row_bytes));
    match ty {
        QuantType::Q4_0 => arrange(rows_in, strips, shape, |r, s, d| {
            pack_small(false, false, r, s, d)
        }),
        QuantType::Q4_1 => arrange(rows_in, strips, shape, |r, s, d| {
            pack_small(true, false, r, s, d)
        }),
        QuantType::Q5_0 => arrange(rows_in, strips, shape, |r, s, d| {
            pack_small(false, true, r, s, d)
        }),
        QuantType::Q5_1 => arrange(rows_in, strips, shape, |r, s, d| {
            pack_small(true, true, r, s, d)
        }),
        QuantType::Q8_0 => arrange(rows_in, strips, shape, pack_q8_0),
        QuantType::Q4_K => arrange(rows_in, strips, shape, |r, s, d| pack_k4(false, r, s, d)),
        QuantType::Q5_K => arrange(rows_in, strips, shape, |r, s, d| pack_k4(true, r, s, d)),
        QuantType::Q6_K => arrange(rows_in, strips, shape, pack_q6_k),
        _ => unreachable!("{ty} has no strip order"),
    }
    tail.copy_from_slice(&bytes[whole * row_bytes..]);
}

/// The whole strips of rows `rows` (of `ty`, `row_bytes` each) arranged into `strips`, a strip
/// per rayon task, `pack` putting row `r`'s stored block into a strip block. Generic over `pack`
/// so that each format's packing is inlined into its loop. A strip's rows are read one after
/// another (the source in order), its strip blocks written within the strip (tens of kilobytes:
/// in cache). Packing a word at a time rather than a level at a time, in this order, made loads
/// of Llama-1B GGUF files 2-3x faster on a 2-core Zen 1 (Q4_0, 760 MB: 1.46 s -> 0.52 s; Q5_K_M
/// 2.33 -> 0.70 s; Q8_0 1.09 -> 0.80 s; BENCHMARKS.md, issue 35).
fn arrange(
    rows: &[u8],
    strips: &mut [u8],
    (ty, row_bytes): (QuantType, usize),
    pack: impl Fn(usize, &[u8], &mut [u8]) + Sync,
) {
    use rayon::prelude::*;
    let (block_bytes, strip_block) = (ty.block_bytes(), strip_block_bytes(ty));
    let strip_bytes = row_bytes / block_bytes * strip_block;
    rows.par_chunks_exact(STRIP_ROWS * row_bytes)
        .zip(strips.par_chunks_exact_mut(strip_bytes))
        .for_each(|(strip, dst)| {
            for (r, row) in strip.chunks_exact(row_bytes).enumerate() {
                for (src, dst) in row
                    .chunks_exact(block_bytes)
                    .zip(dst.chunks_exact_mut(strip_block))
                {
                    pack(r, src, dst);
                }
            }
        });
}

/// Row `r` (within its strip) of the strip `strip` (`cols` values of `ty` per row) in row order,
/// into `row` (one stored row's bytes).
///
/// # Panics
/// When `ty` has no strip order or the slices do not fit (caller bugs).
pub(crate) fn strip_row(ty: QuantType, strip: &[u8], cols: usize, r: usize, row: &mut [u8]) {
    assert!(
        has_strips(ty)
            && r < STRIP_ROWS
            && ty.bytes_for(cols) == Some(row.len())
            && strip.len() == cols / ty.block_size() * strip_block_bytes(ty),
        "strip_row: operands do not fit"
    );
    for (src, dst) in strip
        .chunks_exact(strip_block_bytes(ty))
        .zip(row.chunks_exact_mut(ty.block_bytes()))
    {
        unpack_block(ty, r, src, dst);
    }
}

/// `bytes` in strips (a `rows × cols` matrix of `ty`) back in row order.
///
/// # Panics
/// When `ty` has no strip order or `bytes` is not the matrix in strips (caller bugs).
pub(crate) fn from_strips(ty: QuantType, bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(
        strips_len(ty, rows, cols) == Some(bytes.len()),
        "strips: {} bytes are not {rows} rows of {cols} {ty} values in strips",
        bytes.len()
    );
    let row_bytes = ty.bytes_for(cols).expect("whole blocks per row");
    let whole = rows / STRIP_ROWS * STRIP_ROWS;
    let strip_bytes = strip_block_bytes(ty) * (cols / ty.block_size());
    let mut out = vec![0u8; rows * row_bytes];
    let (rows_out, tail) = out.split_at_mut(whole * row_bytes);
    for (strip, dst) in bytes
        .chunks_exact(strip_bytes)
        .take(whole / STRIP_ROWS)
        .zip(rows_out.chunks_exact_mut(STRIP_ROWS * row_bytes))
    {
        for (r, row) in dst.chunks_exact_mut(row_bytes).enumerate() {
            strip_row(ty, strip, cols, r, row);
        }
    }
    tail.copy_from_slice(&bytes[whole / STRIP_ROWS * strip_bytes..]);
    out
}

/// The low nibbles of the bytes of a word.
const LOW: u64 = 0x0f0f_0f0f_0f0f_0f0f;

/// The little-endian `u64` at `at` of `bytes`.
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The little-endian `u32` at `at` of `bytes`.
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Row `r`'s 32 levels (each below 16), `eights[c]` holding values `8c..8c + 8` one per byte, into
/// the nibble groups `groups`: row `r`'s 4 bytes of group `c` are the word's low half with its high
/// half shifted into their high nibbles (a level below 16 shifted by 4 stays in its byte).
fn put_nibble_words(groups: &mut [u8], r: usize, eights: [u64; 4]) {
    for (c, eight) in eights.into_iter().enumerate() {
        let word = (eight as u32) | (((eight >> 32) as u32) << 4);
        groups[64 * c + 4 * r..][..4].copy_from_slice(&word.to_le_bytes());
    }
}

/// Row `r`'s fifth bits into the 64 bytes of `bits`: `bit(g)`, for values `4g..4g + 4`, is a word
/// whose byte `j` holds the fifth bit of value `4g + j` in its lowest bit (the others 0); byte `j` of
/// the row's word takes it at bit `g`.
fn put_fifth_words(bits: &mut [u8], r: usize, bit: impl Fn(usize) -> u32) {
    let word = (0..8).fold(0u32, |word, g| word | (bit(g) << g));
    bits[4 * r..4 * r + 4].copy_from_slice(&word.to_le_bytes());
}

/// The 4 low bits of `nibble` moved to the lowest bits of the 4 bytes of a word: the multiplier's
/// shifts by 0, 7, 14 and 21 put bit `j` at `8j`, and no two shifted bits meet (`i + 7m = i' + 7m'`
/// needs `i = i'` for bits below 4), so nothing carries.
fn spread_bits(nibble: u32) -> u32 {
    ((nibble & 0x0f) * 0x0020_4081) & 0x0101_0101
}

/// Row `r`'s stored block `src` of a 32-value nibble format (with a minimum: Q4_1, Q5_1; with a
/// fifth bit: Q5_0, Q5_1) into the strip block `dst`. Stored, byte `j` of the 16 holds value `j`
/// in its low nibble and value `j + 16` in its high one; bit `v` of the fifth bits' word, value
/// `v`'s.
fn pack_small(minimum: bool, fifth: bool, r: usize, src: &[u8], dst: &mut [u8]) {
    let (mins, nibbles, high, _) = small_strip(minimum, fifth);
    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
    if minimum {
        dst[mins + 2 * r..mins + 2 * r + 2].copy_from_slice(&src[2..4]);
    }
    let qs = 2 + 2 * usize::from(minimum) + 4 * usize::from(fifth);
    let (low, high_half) = (u64_at(src, qs), u64_at(src, qs + 8));
    let eights = [
        low & LOW,
        high_half & LOW,
        (low >> 4) & LOW,
        (high_half >> 4) & LOW,
    ];
    put_nibble_words(&mut dst[nibbles..nibbles + 256], r, eights);
    if fifth {
        let qh = u32_at(src, qs - 4);
        put_fifth_words(&mut dst[high..high + 64], r, |g| spread_bits(qh >> (4 * g)));
    }
}

/// Row `r`'s stored Q8_0 block `src` into the strip block `dst`: values `4g..4g + 4` go to group
/// `g` as one word, each level plus 128.
fn pack_q8_0(r: usize, src: &[u8], dst: &mut [u8]) {
    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
    for g in 0..8 {
        let word = u32_at(src, 2 + 4 * g) ^ 0x8080_8080;
        dst[32 + 64 * g + 4 * r..][..4].copy_from_slice(&word.to_le_bytes());
    }
}

/// Row `r`'s stored Q4_K (Q5_K with `fifth`) block `src` into the strip block `dst`. Stored,
/// sub-block `s`'s value `j` is nibble `s % 2` of byte `(s / 2) · 32 + j` of the levels, and with
/// Q5_K its fifth bit bit `s` of byte `16 + j`.
fn pack_k4(fifth: bool, r: usize, src: &[u8], dst: &mut [u8]) {
    let stride = k4_sub_block(fifth);
    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
    dst[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&src[2..4]);
    let qs = if fifth { 48 } else { 16 };
    for s in 0..8 {
        let (sc, m) = super::scale_min_k4(&src[4..16], s);
        dst[64 + s * STRIP_ROWS + r] = sc;
        dst[192 + s * STRIP_ROWS + r] = m;
        let eights = std::array::from_fn(|c| {
            (u64_at(src, qs + (s / 2) * 32 + 8 * c) >> (4 * (s % 2))) & LOW
        });
        let at = 320 + stride * s;
        put_nibble_words(&mut dst[at..at + 256], r, eights);
        if fifth {
            put_fifth_words(&mut dst[at + 256..at + 320], r, |g| {
                (u32_at(src, 16 + 4 * g) >> s) & 0x0101_0101
            });
        }
    }
}

/// Row `r`'s stored Q6_K block `src` into the strip block `dst`. Stored, the 32 values of chunk `c` (`a = c / 4`, `k = c % 4`) have their low 4 bits in nibble `k / 2`
/// of `ql[a·64 + (k % 2)·32..][..32]` and their high 2 bits at bit `2k` of `qh[a·32..][..32]`.
fn pack_q6_k(r: usize, src: &[u8], dst: &mut [u8]) {
    dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
    for sub in 0..16 {
        dst[32 + sub * STRIP_ROWS + r] = src[192 + sub];
    }
    for c in 0..8 {
        let (a, k) = (c / 4, c % 4);
        let at = 288 + 384 * c;
        let low = a * 64 + (k % 2) * 32;
        let eights = std::array::from_fn(|e| (u64_at(src, low + 8 * e) >> (4 * (k / 2))) & LOW);
        put_nibble_words(&mut dst[at..at + 256], r, eights);
        // Half h, bits 2i of byte j: the high bits of value 4 · (4h + i) + j, stored in byte
        // 16h + 4i + j of this chunk's 32 bytes of `qh`.
        for h in 0..2 {
            let word = (0..4).fold(0u32, |word, i| {
                let bits = (u32_at(src, 128 + a * 32 + 16 * h + 4 * i) >> (2 * k)) & 0x0303_0303;
                word | (bits << (2 * i))
            });
            dst[at + 256 + 64 * h + 4 * r..][..4].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// Row `r`'s block of the strip block `src`, as stored, into `dst`.
fn unpack_block(ty: QuantType, r: usize, src: &[u8], dst: &mut [u8]) {
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 => {
            let (minimum, fifth) = (ty.has_minimum(), ty.has_fifth_bit());
            let (mins, at, high, _) = small_strip(minimum, fifth);
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            if minimum {
                dst[2..4].copy_from_slice(&src[mins + 2 * r..mins + 2 * r + 2]);
            }
            let mut levels = nibbles(&src[at..at + 256], r);
            let qs = 2 + 2 * usize::from(minimum) + 4 * usize::from(fifth);
            if fifth {
                for (v, bit) in levels.iter_mut().zip(fifth_bits(&src[high..high + 64], r)) {
                    *v |= bit << 4;
                }
                let (qh, qs) = dst[qs - 4..].split_at_mut(4);
                super::blocks::pack5(&levels, qh, &mut qs[..16]);
            } else {
                for j in 0..16 {
                    dst[qs + j] = levels[j] | (levels[j + 16] << 4);
                }
            }
        }
        QuantType::Q8_0 => {
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            for v in 0..32 {
                dst[2 + v] = src[32 + (v / 4) * 64 + 4 * r + v % 4] ^ 0x80;
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let fifth = ty == QuantType::Q5_K;
            let (stride, qs) = (k4_sub_block(fifth), if fifth { 48 } else { 16 });
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            dst[2..4].copy_from_slice(&src[32 + 2 * r..32 + 2 * r + 2]);
            let sc: [u8; 8] = std::array::from_fn(|s| src[64 + s * STRIP_ROWS + r]);
            let m: [u8; 8] = std::array::from_fn(|s| src[192 + s * STRIP_ROWS + r]);
            // ggml's packing of 8 six-bit scales and minimums in 12 bytes (what
            // `scale_min_k4` reads): sub-blocks 0..4 in the low 6 bits of bytes 0..8, the others'
            // low 4 bits in bytes 8..12 and their high 2 bits in the top of bytes 0..8.
            let packed = &mut dst[4..16];
            for j in 0..4 {
                packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
                packed[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
            }
            if fifth {
                dst[16..48].fill(0);
            }
            for s in 0..8 {
                let at = 320 + stride * s;
                let levels = nibbles(&src[at..at + 256], r);
                if fifth {
                    let bits = fifth_bits(&src[at + 256..at + 320], r);
                    for (j, bit) in bits.into_iter().enumerate() {
                        dst[16 + j] |= bit << s;
                    }
                }
                for (j, &level) in levels.iter().enumerate() {
                    let at = qs + (s / 2) * 32 + j;
                    dst[at] = if s % 2 == 0 {
                        (dst[at] & 0xf0) | level
                    } else {
                        (dst[at] & 0x0f) | (level << 4)
                    };
                }
            }
        }
        QuantType::Q6_K => {
            dst[208..210].copy_from_slice(&src[2 * r..2 * r + 2]);
            for sub in 0..16 {
                dst[192 + sub] = src[32 + sub * STRIP_ROWS + r];
            }
            let (ql, qh) = dst[..192].split_at_mut(128);
            ql.fill(0);
            qh.fill(0);
            for c in 0..8 {
                let at = 288 + 384 * c;
                let low = nibbles(&src[at..at + 256], r);
                for (j, &low) in low.iter().enumerate() {
                    let v = 32 * c + j;
                    let (h, i, b) = (j / 16, (j / 4) % 4, j % 4);
                    let high = (src[at + 256 + 64 * h + 4 * r + b] >> (2 * i)) & 0x03;
                    let (a, k, j) = (v / 128, (v / 32) % 4, v % 32);
                    ql[a * 64 + (k % 2) * 32 + j] |= low << (4 * (k / 2));
                    qh[a * 32 + j] |= high << (2 * k);
                }
            }
        }
        _ => unreachable!("{ty} has no strip order"),
    }
}

/// The byte of nibble groups that holds value `v` (0..32) of row `r`, and whether in its high
/// nibble.
fn nibble_at(r: usize, v: usize) -> (usize, bool) {
    ((v / 8) * 64 + 4 * r + v % 4, v % 8 >= 4)
}

/// Row `r`'s 32 fifth bits (0 or 1) from `bits`.
fn fifth_bits(bits: &[u8], r: usize) -> [u8; 32] {
    std::array::from_fn(|v| (bits[4 * r + v % 4] >> (v / 4)) & 1)
}

/// Row `r`'s 32 levels from the nibble groups `groups`.
fn nibbles(groups: &[u8], r: usize) -> [u8; 32] {
    std::array::from_fn(|v| {
        let (at, high) = nibble_at(r, v);
        (groups[at] >> (4 * usize::from(high))) & 0x0f
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(ty: QuantType, rows: usize, cols: usize) -> Vec<u8> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        (0..ty.bytes_for(rows * cols).unwrap())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    #[test]
    fn strips_hold_the_same_blocks_and_come_back_bit_for_bit() {
        for ty in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q8_0,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            for rows in [16, 35, 3] {
                let cols = 512;
                let stored = bytes(ty, rows, cols);
                let strips = to_strips(ty, &stored, rows, cols);
                assert_eq!(Some(strips.len()), strips_len(ty, rows, cols));
                assert_eq!(from_strips(ty, &strips, rows, cols), stored, "{ty} {rows}");
                // The tail rows stay in row order.
                let tail = rows % STRIP_ROWS * stored.len() / rows;
                assert_eq!(strips[strips.len() - tail..], stored[stored.len() - tail..]);
            }
        }
        // Q4_0 and Q8_0 take the same bytes; Q4_K 148 per row and block against 144.
        assert_eq!(strips_len(QuantType::Q4_0, 32, 64), Some(32 * 2 * 18));
        assert_eq!(strips_len(QuantType::Q8_0, 17, 32), Some(17 * 34));
        assert_eq!(strips_len(QuantType::Q4_K, 16, 256), Some(16 * 148));
        assert_eq!(strips_len(QuantType::Q6_K, 16, 256), Some(16 * 210));
        assert_eq!(strips_len(QuantType::Q5_K, 16, 256), Some(16 * 180));
        for ty in [QuantType::Q4_1, QuantType::Q5_0, QuantType::Q5_1] {
            assert_eq!(
                strips_len(ty, 16, 64),
                Some(16 * 2 * ty.block_bytes()),
                "{ty}"
            );
        }
    }

    #[test]
    fn each_value_sits_where_the_layout_says() {
        let (rows, cols) = (16, 512);
        // Q4_0: row 5, value 13 of the second block = 8 · 1 + 4 + 1: group 1, byte 1, high nibble.
        let ty = QuantType::Q4_0;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 32 * 18) + 18..][..18];
        let block = &strips[288..576];
        assert_eq!(&block[10..12], &src[..2]);
        assert_eq!(block[32 + 64 + 4 * 5 + 1] >> 4, src[2 + 13] & 0x0f);
        // Q8_0: value 13 is group 3, byte 1, plus 128.
        let ty = QuantType::Q8_0;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 32 * 34) + 34..][..34];
        let block = &strips[544..1088];
        assert_eq!(block[32 + 3 * 64 + 4 * 5 + 1], src[2 + 13] ^ 0x80);
        // Q4_K: row 5, sub-block 3 (high nibbles of bytes 32..64), value 13; its scale and minimum.
        let ty = QuantType::Q4_K;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 256 * 144)..][..144];
        let block = &strips[..2368];
        let (sc, m) = crate::quant::scale_min_k4(&src[4..16], 3);
        assert_eq!((block[64 + 3 * 16 + 5], block[192 + 3 * 16 + 5]), (sc, m));
        assert_eq!(&block[32 + 10..32 + 12], &src[2..4]);
        assert_eq!(
            block[320 + 3 * 256 + 64 + 4 * 5 + 1] >> 4,
            src[16 + 32 + 13] >> 4
        );
        // Q6_K: row 5, value 45 (chunk 1, value 13: low nibble in group 1 byte 1 high, high bits
        // in half 0, byte 4 · 5 + 1, bits 2 · 3), stored at a = 0, k = 1, j = 13.
        let ty = QuantType::Q6_K;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 256 * 210)..][..210];
        let block = &strips[..3360];
        let low = (src[32 + 13] & 0x0f, (src[128 + 13] >> 2) & 3);
        let chunk = &block[288 + 384..];
        assert_eq!(chunk[64 + 4 * 5 + 1] >> 4, low.0);
        assert_eq!((chunk[256 + 4 * 5 + 1] >> 6) & 3, low.1);
        assert_eq!(block[32 + 7 * 16 + 5], src[192 + 7]);
        assert_eq!(&block[10..12], &src[208..210]);
        // Q5_0: row 5, value 13 of the second block: its fifth bit at byte 4 · 5 + 1, bit 3.
        let ty = QuantType::Q5_0;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 32 * 22) + 22..][..22];
        let block = &strips[352..704];
        let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
        assert_eq!((block[288 + 4 * 5 + 1] >> 3) & 1, ((qh >> 13) & 1) as u8);
        assert_eq!(block[32 + 64 + 4 * 5 + 1] >> 4, src[6 + 13] & 0x0f);
        // Q5_K: row 5, sub-block 3, value 13: the nibble as Q4_K's, the fifth bit at bit 3 of
        // the stored byte 16 + 13.
        let ty = QuantType::Q5_K;
        let stored = bytes(ty, rows, cols);
        let strips = to_strips(ty, &stored, rows, cols);
        let src = &stored[5 * (cols / 256 * 176)..][..176];
        let sub = &strips[320 + 3 * 320..][..320];
        assert_eq!(sub[64 + 4 * 5 + 1] >> 4, src[48 + 32 + 13] >> 4);
        assert_eq!((sub[256 + 4 * 5 + 1] >> 3) & 1, (src[16 + 13] >> 3) & 1);
    }
}
