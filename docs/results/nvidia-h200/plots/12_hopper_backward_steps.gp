set terminal pngcairo size 1200,640 font 'sans,11'
set output '12_hopper_backward_steps.png'
set title "Stage 12, what each step bought: backward TFLOP/s, fp16 (H = 2048/d, B = 16384/N), one command\n{/*0.8 NVIDIA H200, CUDA 13.0, 2026-11-30}"
set ylabel 'TFLOP/s'
set grid ytics
set yrange [0:*]
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 noborder
set boxwidth 0.9
set key outside right top noenhanced
set xtics noenhanced rotate by -25
plot '12_hopper_backward_steps_data/steps.dat' using 2:xtic(1) title '1: 09 (mma.sync, cp.async)' lc rgb '#1b9e77', \
     '12_hopper_backward_steps_data/steps.dat' using 3:xtic(1) title '2: + TMA' lc rgb '#d95f02', \
     '12_hopper_backward_steps_data/steps.dat' using 4:xtic(1) title '3: + wgmma' lc rgb '#7570b3', \
     '12_hopper_backward_steps_data/steps.dat' using 5:xtic(1) title '4: + warp specialisation' lc rgb '#e7298a', \
     '12_hopper_backward_steps_data/steps.dat' using 6:xtic(1) title '5: + third stage' lc rgb '#66a61e', \
     '12_hopper_backward_steps_data/steps.dat' using 7:xtic(1) title '6: + early release' lc rgb '#e6ab02', \
     '12_hopper_backward_steps_data/steps.dat' using 8:xtic(1) title '7: + shared space, descriptors' lc rgb '#a6761d', \
     '12_hopper_backward_steps_data/steps.dat' using 9:xtic(1) title '8: + dQ by box' lc rgb '#666666', \
     '12_hopper_backward_steps_data/steps.dat' using 10:xtic(1) title '9: + mask split' lc rgb '#1f78b4', \
     '12_hopper_backward_steps_data/steps.dat' using 11:xtic(1) title 'SDPA flash (FlashAttention-2)' lc rgb '#b2182b', \
     '12_hopper_backward_steps_data/steps.dat' using 12:xtic(1) title 'SDPA cuDNN' lc rgb '#000000'
