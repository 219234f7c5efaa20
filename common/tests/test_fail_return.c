/* attn_fail with a return point, as the stage libraries use it: it jumps back with the exit
 * code and keeps the line the program would print; the point is used once, so a later failure
 * exits as in a program. */
#include <setjmp.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attention.h"
#include "expect.h"

int main(void) {
  jmp_buf back;
  attn_program_name = "test_fail_return";
  strcpy(attn_failure_note, " (seed 7)");
  if (setjmp(back) == 0) {
    attn_fail_return_to(&back);
    attn_fail(EXIT_BAD_USAGE, "needs %d bytes", 99);
    EXPECT(0, "attn_fail returned instead of jumping back");
  }
  EXPECT(attn_last_failure_code() == EXIT_BAD_USAGE, "code %d, expected 2",
         attn_last_failure_code());
  EXPECT(strcmp(attn_last_failure(), "test_fail_return: needs 99 bytes (seed 7)") == 0, "line '%s'",
         attn_last_failure());
  /* The point was used: a second failure ends the process with its code, as in a program,
   * and prints the line it would have kept. */
  int err[2];
  EXPECT(pipe(err) == 0, "pipe failed");
  fflush(NULL);
  pid_t child = fork();
  if (child == 0) {
    dup2(err[1], STDERR_FILENO);
    if (setjmp(back) == 0) attn_fail(EXIT_CHECK_FAILED, "second failure");
    _exit(0); /* jumped back: the point was not cleared */
  }
  close(err[1]);
  char printed[256] = "";
  size_t got = 0;
  for (ssize_t r;
       got < sizeof printed - 1 && (r = read(err[0], printed + got, sizeof printed - 1 - got)) > 0;)
    got += (size_t)r;
  printed[got] = '\0';
  close(err[0]);
  int status = 0;
  EXPECT(child > 0 && waitpid(child, &status, 0) == child, "fork or wait failed");
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == EXIT_CHECK_FAILED,
         "second failure: status %d, expected exit 1", status);
  EXPECT(strcmp(printed, "test_fail_return: second failure (seed 7)\n") == 0,
         "second failure printed '%s'", printed);
  return failures != 0;
}
