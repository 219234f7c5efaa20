set terminal pngcairo size 1100,640 font 'sans,11'
set output 'ladder.png'
set title "The ladder: forward TFLOP/s at N = 4096, d = 64 (CPU: 1 head; GPU: H = 32, B = 4)\n{/*0.8 AMD EPYC, 2026-11-21; NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-21; NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-25; NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-26}"
set ylabel 'TFLOP/s (log scale)'
set logscale y
set grid ytics
set boxwidth 0.6
set xtics rotate by -30 noenhanced
set key top left vertical maxrows 3
set yrange [0.0001:10000]
set xrange [-0.6:15.6]
plot 'ladder_data/bars.dat' using 1:2:xtic(3) with boxes fs solid 0.7 lc rgb '#1b9e77' notitle, \
     'ladder_data/bars.dat' using 1:($2*1.15):(sprintf('%.3g', $2)) with labels notitle, \
     460.75 with lines dt 2 lw 2 lc rgb '#d95f02' title 'PyTorch sdpa_cudnn fp16 461' noenhanced, \
     304.89 with lines dt 2 lw 2 lc rgb '#7570b3' title 'PyTorch sdpa_flash bf16 305' noenhanced, \
     302.54 with lines dt 2 lw 2 lc rgb '#e7298a' title 'PyTorch sdpa_flash fp16 303' noenhanced, \
     135.2 with lines dt 2 lw 2 lc rgb '#66a61e' title 'PyTorch sdpa_efficient fp16 135' noenhanced, \
     34.02 with lines dt 2 lw 2 lc rgb '#e6ab02' title 'PyTorch sdpa_efficient fp32 34' noenhanced
