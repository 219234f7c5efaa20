set terminal pngcairo size 1000,640 font 'sans,11'
set output 'decode_flush.png'
set title "Decode at B = 1: K/V bytes a second / copy bandwidth, by how the L2 was flushed\n{/*0.8 NVIDIA H100 80GB HBM3, CUDA 13.0, 2026-11-25}"
set xlabel 'cache length L (keys)'
set ylabel 'fraction of the measured copy bandwidth'
set grid
set key outside right top
set logscale x 2
plot 'decode_flush_data/s0.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1b9e77' title '11, convention (dirty L2)' noenhanced, \
     'decode_flush_data/s1.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#1b9e77' title '11, clean L2' noenhanced, \
     'decode_flush_data/s2.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#d95f02' title 'cuDNN, convention (dirty L2)' noenhanced, \
     'decode_flush_data/s3.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#d95f02' title 'cuDNN, clean L2' noenhanced, \
     'decode_flush_data/s4.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#7570b3' title 'read only, convention (dirty L2)' noenhanced, \
     'decode_flush_data/s5.dat' using 1:2 with linespoints lw 2 pt 7 dt 2 lc rgb '#7570b3' title 'read only, clean L2' noenhanced, \
     0.8 with lines dt 2 lw 2 lc rgb '#e6ab02' title 'target at B = 1, L >= 32k' noenhanced
