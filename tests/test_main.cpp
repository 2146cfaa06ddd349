// test_main.cpp — one gtest main for the in-process suite: MPI and Kokkos live for the whole run.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

#include "h5.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  zero3d::h5::quiet_errors();
  ::testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
