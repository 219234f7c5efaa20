set terminal pngcairo size 1200,640 font 'sans,11'
set output '09_swizzle_pipeline_switches.png'
set title "Stage 09, what each technique buys: TFLOP/s gain over the stage with it switched off\n{/*0.8 mean of N = 4096 and 16384, causal and not, fp16 (H = 2048/d, B = 16384/N), commands 05c6b0d-ab, 05c6b0d-ab2; NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-28}"
set ylabel 'gain (%)'
set grid ytics
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 noborder
set boxwidth 0.9
set key outside right top noenhanced
set xtics noenhanced rotate by -25
plot '09_swizzle_pipeline_switches_data/switches.dat' using 2:xtic(1) title 'forward, d = 64' lc rgb '#1b9e77', \
     '09_swizzle_pipeline_switches_data/switches.dat' using 3:xtic(1) title 'forward, d = 128' lc rgb '#d95f02', \
     '09_swizzle_pipeline_switches_data/switches.dat' using 4:xtic(1) title 'backward, d = 64' lc rgb '#7570b3', \
     '09_swizzle_pipeline_switches_data/switches.dat' using 5:xtic(1) title 'backward, d = 128' lc rgb '#e7298a'
