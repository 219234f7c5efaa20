set terminal pngcairo size 1200,640 font 'sans,11'
set output '13_masks.png'
set title "Stages 13 and 14 beside FlexAttention: window 4096, softcap 50, varlen (fp16, causal)\n{/*0.8 NVIDIA H200, CUDA 13.0, 2026-12-01; TFLOP/s of the visible pairs}"
set ylabel 'TFLOP/s'
set grid ytics
set yrange [0:*]
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 noborder
set boxwidth 0.9
set key outside right top noenhanced
set xtics noenhanced rotate by -25
plot '13_masks_data/masks.dat' using 2:xtic(1) title 'stage 13' lc rgb '#1b9e77', \
     '13_masks_data/masks.dat' using 3:xtic(1) title 'FlexAttention' lc rgb '#d95f02', \
     '13_masks_data/masks.dat' using 4:xtic(1) title '09, dense causal, as many tokens' lc rgb '#7570b3', \
     '13_masks_data/masks.dat' using 5:xtic(1) title 'stage 14 (Hopper: the window)' lc rgb '#e7298a'
