set terminal pngcairo size 1000,640 font 'sans,11'
set output 'gpu_fwd_d128_causal.png'
set title "GPU forward, d = 128, causal (H = 2048/d, B = 16384/N)\n{/*0.8 NVIDIA H200, CUDA 13.0, 2026-11-21; NVIDIA H200, CUDA 13.0, 2026-11-29; NVIDIA H200, CUDA 13.0, 2026-11-30}"
set xlabel 'N (sequence length)'
set ylabel 'TFLOP/s'
set grid
set key outside right top
set logscale x 2
set logscale y
plot 'gpu_fwd_d128_causal_data/s0.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1b9e77' title '05_causal' noenhanced, \
     'gpu_fwd_d128_causal_data/s1.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#d95f02' title '06_backward' noenhanced, \
     'gpu_fwd_d128_causal_data/s2.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#7570b3' title '07_tensor_cores bf16' noenhanced, \
     'gpu_fwd_d128_causal_data/s3.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e7298a' title '07_tensor_cores fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s4.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#66a61e' title '08_mma_sync bf16' noenhanced, \
     'gpu_fwd_d128_causal_data/s5.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e6ab02' title '08_mma_sync fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s6.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#a6761d' title '09_swizzle_pipeline bf16' noenhanced, \
     'gpu_fwd_d128_causal_data/s7.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#666666' title '09_swizzle_pipeline fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s8.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1f78b4' title '10_hopper_wgmma bf16' noenhanced, \
     'gpu_fwd_d128_causal_data/s9.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#b2182b' title '10_hopper_wgmma fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s10.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#000000' title '11_split_kv_decode fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s11.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#8c564b' title '12_hopper_backward bf16' noenhanced, \
     'gpu_fwd_d128_causal_data/s12.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#17becf' title '12_hopper_backward fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s13.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#bcbd22' title 'cublas_baseline' noenhanced, \
     'gpu_fwd_d128_causal_data/s14.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#1b9e77' title 'sdpa_cudnn fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s15.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#d95f02' title 'sdpa_efficient fp16' noenhanced, \
     'gpu_fwd_d128_causal_data/s16.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#7570b3' title 'sdpa_efficient fp32' noenhanced, \
     'gpu_fwd_d128_causal_data/s17.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#e7298a' title 'sdpa_flash fp16' noenhanced
