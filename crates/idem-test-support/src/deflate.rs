//! Hand-built compressed streams for the server's compression-bomb tests and benchmark.

/// One zlib stream of `n` empty fixed-Huffman blocks (10 bits each), then a final one:
/// valid, decoding to nothing, and about `n * 10 / 8` bytes long.
pub fn empty_fixed_blocks(n: usize) -> Vec<u8> {
    let mut out = vec![0x78, 0x9c];
    let (mut acc, mut bits) = (0u64, 0u32);
    let mut push = |v: u64, k: u32, out: &mut Vec<u8>| {
        acc |= v << bits;
        bits += k;
        while bits >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            bits -= 8;
        }
    };
    for i in 0..=n {
        let last = u64::from(i == n);
        // BFINAL, BTYPE = 01 (fixed), then end-of-block (code 256: seven zero bits).
        push(last | 0b01 << 1, 3, &mut out);
        push(0, 7, &mut out);
    }
    push(0, 7, &mut out); // pad to a byte
    out.extend_from_slice(&[0, 0, 0, 1]); // Adler-32 of nothing
    out
}
