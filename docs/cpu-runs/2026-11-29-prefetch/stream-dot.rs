use std::arch::x86_64::*;
use std::time::Instant;
const B: usize = 34;
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales(w: &[u8], x: &[u8]) -> __m256 {
    let both = _mm_set_epi16(0, 0, 0, 0, 0, 0, i16::from_le_bytes([x[0], x[1]]), i16::from_le_bytes([w[0], w[1]]));
    let f = _mm_cvtph_ps(both);
    _mm256_set1_ps(_mm_cvtss_f32(f) * _mm_cvtss_f32(_mm_shuffle_ps::<1>(f, f)))
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot(w: &[u8], x: &[u8]) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (w, x) in w.chunks_exact(B).zip(x.chunks_exact(B)) {
        let d = scales(w, x);
        let a = _mm256_loadu_si256(w.as_ptr().add(2).cast());
        let b = _mm256_loadu_si256(x.as_ptr().add(2).cast());
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), acc);
    }
    let half = _mm_add_ps(_mm256_extractf128_ps::<1>(acc), _mm256_castps256_ps128(acc));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot2<const PF: usize>(w: &[u8], x: &[u8]) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 2];
    let n = w.len() / B;
    for i in 0..n {
        let (wb, xb) = (&w[i * B..], &x[i * B..]);
        if PF > 0 { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(i * B + PF).cast()); }
        let d = scales(wb, xb);
        let a = _mm256_loadu_si256(wb.as_ptr().add(2).cast());
        let b = _mm256_loadu_si256(xb.as_ptr().add(2).cast());
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
        acc[i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), acc[i & 1]);
    }
    let acc = _mm256_add_ps(acc[0], acc[1]);
    let half = _mm_add_ps(_mm256_extractf128_ps::<1>(acc), _mm256_castps256_ps128(acc));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
}
fn run(f: unsafe fn(&[u8], &[u8]) -> f32, w: &[u8], x: &[u8], out: &mut [f32], per: usize) -> f64 {
    let t = Instant::now();
    for r in 0..out.len() { out[r] = unsafe { f(&w[r * per..(r + 1) * per], x) }; }
    let dt = t.elapsed().as_secs_f64();
    w.len() as f64 / dt / 1e9
}
fn main() {
    let rows = 262144; let k = 640; let per = k / 32 * B;
    let w: Vec<u8> = (0..rows * per).map(|i| ((i * 131) % 251) as u8 & 0x3f).collect();
    let x: Vec<u8> = (0..per).map(|i| ((i * 17) % 97) as u8 & 0x3f).collect();
    let mut out = vec![0f32; rows];
    let variants: [(&str, unsafe fn(&[u8], &[u8]) -> f32); 6] = [("base", dot), ("2acc", dot2::<0>), ("2acc pf512", dot2::<512>), ("2acc pf1024", dot2::<1024>), ("2acc pf2048", dot2::<2048>), ("2acc pf4096", dot2::<4096>)];
    let mut res: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..9 { for (i, (_, f)) in variants.iter().enumerate() { res[i].push(run(*f, &w, &x, &mut out, per)); } }
    for (i, (name, _)) in variants.iter().enumerate() { let mut v = res[i].clone(); v.sort_by(f64::total_cmp); println!("{name:<12} median {:.2} GB/s (min {:.2}, max {:.2})", v[4], v[0], v[8]); }
    std::hint::black_box(&out);
}
