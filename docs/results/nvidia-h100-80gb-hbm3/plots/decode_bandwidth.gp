set terminal pngcairo size 1000,640 font 'sans,11'
set output 'decode_bandwidth.png'
set title "Decode: K/V bytes a second / copy bandwidth (H = 32, Hkv = 8, d = 128, fp16)\n{/*0.8 NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-25}"
set xlabel 'cache length L (keys)'
set ylabel 'fraction of the measured copy bandwidth'
set grid
set key outside right top
set logscale x 2
plot 'decode_bandwidth_data/s0.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1b9e77' title '11 B=1' noenhanced, \
     'decode_bandwidth_data/s1.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#d95f02' title 'best SDPA B=1' noenhanced, \
     'decode_bandwidth_data/s2.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#7570b3' title 'read only (torch.sum of K, V) B=1' noenhanced, \
     'decode_bandwidth_data/s3.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e7298a' title '11 B=8' noenhanced, \
     'decode_bandwidth_data/s4.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#66a61e' title 'best SDPA B=8' noenhanced, \
     'decode_bandwidth_data/s5.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#e6ab02' title '11 B=32' noenhanced, \
     'decode_bandwidth_data/s6.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#a6761d' title 'best SDPA B=32' noenhanced, \
     0.8 with lines dt 2 lw 2 lc rgb '#e6ab02' title 'target at B = 1, L >= 32k' noenhanced
