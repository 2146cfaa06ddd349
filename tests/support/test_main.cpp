// test_main.cpp — one gtest main for the in-process suite: MPI and Kokkos live for the whole run.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

#include "io/h5.hpp"

int main(int argc, char** argv) {
  int level = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
  Kokkos::initialize(argc, argv);
  zero3d::h5::quiet_errors();
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one report per run; a failure on any rank still fails the exit code
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
