set terminal pngcairo size 1200,640 font 'sans,11'
set output '10_hopper_wgmma_steps.png'
set title "Stage 10, what each Hopper technique bought: forward TFLOP/s, fp16 (H = 2048/d, B = 16384/N), command 7c3a390\n{/*0.8 NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-25}"
set ylabel 'TFLOP/s'
set grid ytics
set yrange [0:*]
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 noborder
set boxwidth 0.9
set key outside right top noenhanced
set xtics noenhanced rotate by -25
plot '10_hopper_wgmma_steps_data/steps.dat' using 2:xtic(1) title '09 (mma.sync, cp.async)' lc rgb '#1b9e77', \
     '10_hopper_wgmma_steps_data/steps.dat' using 3:xtic(1) title 'TMA alone' lc rgb '#d95f02', \
     '10_hopper_wgmma_steps_data/steps.dat' using 4:xtic(1) title '+ wgmma' lc rgb '#7570b3', \
     '10_hopper_wgmma_steps_data/steps.dat' using 5:xtic(1) title '+ warp specialisation' lc rgb '#e7298a', \
     '10_hopper_wgmma_steps_data/steps.dat' using 6:xtic(1) title '+ overlap (stage 10)' lc rgb '#66a61e', \
     '10_hopper_wgmma_steps_data/steps.dat' using 7:xtic(1) title 'SDPA flash (FlashAttention-2)' lc rgb '#e6ab02', \
     '10_hopper_wgmma_steps_data/steps.dat' using 8:xtic(1) title 'SDPA cuDNN' lc rgb '#a6761d'
