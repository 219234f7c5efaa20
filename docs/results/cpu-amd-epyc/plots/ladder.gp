set terminal pngcairo size 1100,640 font 'sans,11'
set output 'ladder.png'
set title "The ladder: forward TFLOP/s at N = 4096, d = 64 (CPU: 1 head; GPU: H = 32, B = 4)\n{/*0.8 AMD EPYC, 2026-11-21}"
set ylabel 'TFLOP/s (log scale)'
set logscale y
set grid ytics
set boxwidth 0.6
set xtics rotate by -30 noenhanced
set key top left vertical maxrows 3
set yrange [0.0001:0.1]
set xrange [-0.6:2.6]
plot 'ladder_data/bars.dat' using 1:2:xtic(3) with boxes fs solid 0.7 lc rgb '#1b9e77' notitle, \
     'ladder_data/bars.dat' using 1:($2*1.15):(sprintf('%.3g', $2)) with labels notitle
