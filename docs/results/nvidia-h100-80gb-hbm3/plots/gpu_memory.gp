set terminal pngcairo size 1000,640 font 'sans,11'
set output 'gpu_memory.png'
set title "GPU device memory, forward, d = 64 (B = 1, H = 32)\n{/*0.8 NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-21; NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-26}"
set xlabel 'N (sequence length)'
set ylabel 'device bytes (inputs, outputs, workspace)'
set grid
set key outside right top
set logscale x 2
set logscale y
plot 'gpu_memory_data/s0.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1b9e77' title '03_cuda_forward' noenhanced, \
     'gpu_memory_data/s1.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#d95f02' title '04_shared_memory' noenhanced, \
     'gpu_memory_data/s2.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#7570b3' title '05_causal' noenhanced, \
     'gpu_memory_data/s3.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e7298a' title '06_backward' noenhanced, \
     'gpu_memory_data/s4.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#66a61e' title '08_mma_sync' noenhanced, \
     'gpu_memory_data/s5.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e6ab02' title 'cublas_baseline' noenhanced
