/* router_main.c: `twain-router`, the router daemon alone (router.h). The same
 * command line is `twain router ...`. */
#include "router/router.h"

#include "common/base/log.h"

int main(int argc, char **argv) {
  tw_log_init("twain-router", 0);
  return tw_router_main(argc, argv);
}
