//! Scalar codecs for the stored weight encodings: BF16, E2M1 (the MXFP4 element) and E8M0 (its scale).

/// BF16 bits -> f32 (exact: shift into the top half).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 -> BF16 bits, round-to-nearest-even. NaN stays NaN (quieted, sign kept): plain rounding could
/// carry a NaN whose payload sits in the dropped half into infinity.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    // Adding 0x7FFF plus the lowest kept bit rounds halfway cases towards the even neighbour; finite
    // values past the largest BF16 carry into the exponent and become infinity, as they should.
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

pub(crate) static E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 nibble (0..16) -> value: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign (8 = -0.0).
/// Only the low four bits of `nibble` are read.
#[inline]
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    E2M1[usize::from(nibble & 0xF)]
}

/// E8M0 scale byte -> 2^(s-127): the f32 with bits `s << 23` for s in 1..=254, and 2^-127 (the subnormal
/// with bits 0x0040_0000) for s = 0.
///
/// s = 255 is NaN in the OCP MX spec and never occurs in K3. We return `f32::NAN`, so a corrupt block
/// poisons its products visibly instead of silently; the kernels do not check each block (it would cost
/// a branch per 32 weights), so checkpoint loaders must reject tensors containing 255.
#[inline]
pub fn e8m0_to_f32(s: u8) -> f32 {
    E8M0[usize::from(s)]
}

/// Every scale, so the kernels' per-block lookup is one load instead of a branchy conversion.
pub(crate) static E8M0: [f32; 256] = {
    let mut table = [f32::NAN; 256];
    table[0] = f32::from_bits(0x0040_0000);
    let mut s = 1;
    while s < 255 {
        table[s] = f32::from_bits((s as u32) << 23);
        s += 1;
    }
    table
};

/// Decode one packed MXFP4 row (cols/2 bytes + cols/32 scales) into f32 (for tests and references).
/// Byte j holds element 2j in its low nibble and 2j+1 in its high nibble; each weight is
/// `e2m1 * 2^(s-127)` computed in f32, which is exact (or ±inf when s >= 253 and |e2m1| is large).
///
/// Panics unless `out.len()` is a multiple of 32 and the input lengths match it.
pub fn decode_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    let cols = out.len();
    assert!(
        cols.is_multiple_of(32) && packed.len() * 2 == cols && scales.len() * 32 == cols,
        "decode_mxfp4_row: {cols} outputs need a multiple of 32, {} packed bytes and {} scales; got {} and {}",
        cols / 2,
        cols / 32,
        packed.len(),
        scales.len()
    );
    for ((out, packed), &scale) in out
        .chunks_exact_mut(32)
        .zip(packed.chunks_exact(16))
        .zip(scales)
    {
        decode_mxfp4_block(packed, scale, out);
    }
}

/// Decode one 32-element block: 16 packed bytes and their scale byte.
#[inline]
pub(crate) fn decode_mxfp4_block(packed: &[u8], scale: u8, out: &mut [f32]) {
    let scale = e8m0_to_f32(scale);
    for (pair, &byte) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = e2m1_to_f32(byte & 0xF) * scale;
        pair[1] = e2m1_to_f32(byte >> 4) * scale;
    }
}
