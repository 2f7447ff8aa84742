//! Scalar codecs for the stored weight encodings: BF16, E2M1 (the MXFP4 element), E8M0 (its scale), E4M3
//! (the FP8 element) and the INT4 nibble.

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
        decode_nibbles(packed, &E2M1, e8m0_to_f32(scale), out);
    }
}

/// Decode 32 packed nibbles (MXFP4 and INT4 share the layout: byte k holds element 2k in its low nibble,
/// 2k+1 in its high one) through a 16-entry value table, each value times `scale` in f32.
#[inline]
pub(crate) fn decode_nibbles(packed: &[u8], values: &[f32; 16], scale: f32, out: &mut [f32]) {
    for (pair, &byte) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = values[usize::from(byte & 0xF)] * scale;
        pair[1] = values[usize::from(byte >> 4)] * scale;
    }
}

/// INT4 nibble n -> the signed value n - 8 (compressed-tensors stores q + 8 for q in -8..=7).
pub(crate) static INT4: [f32; 16] = {
    let mut table = [0.0; 16];
    let mut n = 0;
    while n < 16 {
        table[n] = n as f32 - 8.0;
        n += 1;
    }
    table
};

/// float8_e4m3fn byte -> f32, exact: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, subnormals
/// below 2^-6, no infinities, and magnitude 0x7f (bytes 0x7f and 0xff) NaN, which decodes to NaN.
#[inline]
pub fn e4m3_to_f32(byte: u8) -> f32 {
    E4M3[usize::from(byte)]
}

/// The seven magnitude bits of an e4m3 byte moved to f32 bits 20..27 (the three mantissa bits at the top of
/// f32's mantissa) read as the e4m3 value times 2^-120: the exponent biases are 7 and 127, and e4m3
/// subnormals land on f32 subnormals of the same mantissa. Multiplying by this restores the value exactly.
/// The NEON decoder does the same; the AVX2 one goes through fp16 instead, as x86 slows down on f32
/// subnormals. Either way the decoded value is exact, so every path decodes alike.
pub(crate) const E4M3_RESCALE: f32 = f32::from_bits((127 + 120) << 23);
/// The magnitude bits of a decoded e4m3 byte in their f32 position, and their NaN pattern.
pub(crate) const E4M3_MAGNITUDE: u32 = 0x7F << 20;

static E4M3: [f32; 256] = {
    let mut table = [0.0; 256];
    let mut byte = 0;
    while byte < 256 {
        let magnitude = (byte as u32 & 0x7F) << 20;
        let sign = (byte as u32 & 0x80) << 24;
        table[byte] = if magnitude == E4M3_MAGNITUDE {
            f32::NAN
        } else {
            f32::from_bits(sign | magnitude) * E4M3_RESCALE
        };
        byte += 1;
    }
    table
};
