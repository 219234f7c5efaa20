set terminal pngcairo size 1100,640 font 'sans,11'
set output 'ladder.png'
set title "The ladder: forward TFLOP/s at N = 4096, d = 64 (CPU: 1 head; GPU: H = 32, B = 4)\n{/*0.8 AMD EPYC, 2026-11-21; NVIDIA H200, CUDA 13.0, 2026-11-21; NVIDIA H200, CUDA 13.0, 2026-11-29; NVIDIA H200, CUDA 13.0, 2026-11-30}"
set ylabel 'TFLOP/s (log scale)'
set logscale y
set grid ytics
set boxwidth 0.6
set xtics rotate by -30 noenhanced
set key top left vertical maxrows 3
set yrange [0.0001:10000]
set xrange [-0.6:19.6]
plot 'ladder_data/bars.dat' using 1:2:xtic(3) with boxes fs solid 0.7 lc rgb '#1b9e77' notitle, \
     'ladder_data/bars.dat' using 1:($2*1.15):(sprintf('%.3g', $2)) with labels notitle, \
     444.37 with lines dt 2 lw 2 lc rgb '#d95f02' title 'PyTorch sdpa_cudnn fp16 444' noenhanced, \
     438.34 with lines dt 2 lw 2 lc rgb '#7570b3' title 'PyTorch sdpa_cudnn bf16 438' noenhanced, \
     301.89 with lines dt 2 lw 2 lc rgb '#e7298a' title 'PyTorch sdpa_flash fp16 302' noenhanced, \
     300.16 with lines dt 2 lw 2 lc rgb '#66a61e' title 'PyTorch sdpa_flash bf16 300' noenhanced, \
     130.39 with lines dt 2 lw 2 lc rgb '#e6ab02' title 'PyTorch sdpa_efficient fp16 130' noenhanced, \
     35.44 with lines dt 2 lw 2 lc rgb '#a6761d' title 'PyTorch sdpa_efficient fp32 35' noenhanced
