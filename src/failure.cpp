// failure.cpp
#include "failure.hpp"

#include <climits>

#include "base.hpp"

namespace zero3d {

void agree_on_failure(MPI_Comm comm, std::exception_ptr local) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int code = kExitOk;
  std::string message;
  if (local) {
    try {
      std::rethrow_exception(local);
    } catch (const InputError& e) {
      code = kExitBadInput;
      message = e.what();
    } catch (const std::exception& e) {
      code = kExitSystem;
      message = e.what();
    } catch (...) {
      code = kExitSystem;
      message = "unknown exception";
    }
  }
  // first failing rank (MIN) and the worst exit code (MAX: a system failure beats bad input)
  int first = local ? rank : INT_MAX, worst = code;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, comm);
  if (first == INT_MAX) return;
  throw AgreedFailure(rank == first ? message : "", worst, first, rank == first);
}

}  // namespace zero3d
