// agreement.hpp — all ranks of a job train the same model with the same settings.
//
// Ranks started with different configs (an MPMD launch `-np 1 zero3d train a.json : -np 1
// zero3d train b.json`, a config edited on one node only, a different --set) used to train
// silently — garbage, or a hang in a collective whose size depends on the config. At start-up
// of `train`, before any collective whose shape depends on the config, every rank computes a
// 64-bit digest of the "agreement document" and the ranks compare digests:
//
//   - the resolved configuration (Config::resolved: every key after defaults and derivation),
//     less the keys that may legitimately differ per rank (kPerRankKeys in agreement.cpp:
//     training.output_dir and training.peak_gflops, training.comms_timeout; and
//     training.save_dir while no checkpoint is saved or resumed);
//   - for model.init_from, instead of the path, a digest of the file's bytes (and of every
//     shard a Hugging Face index names) under the pseudo-key "model.init_from (file content
//     digest)": nodes whose copies of the file differ would start from different weights,
//     while copies at different paths with the same bytes agree. Without init_from
//     the initial weights are a function of training.seed and the model shape, both compared.
//     Hashing the file costs one sequential read per rank of a file the engine reads whole
//     anyway, and catches what hashing each rank's initial ZeRO partition could not (that
//     would need the engine, and a partition digest says nothing about the other partitions).
//
// Collectives (MPI_COMM_WORLD): one MPI_Allreduce(MIN) of {digest, ~digest} when the ranks
// agree (the common case). On a mismatch, a fixed four more: a broadcast of rank 0's digest,
// an allreduce(MIN) to find the lowest rank that differs from rank 0, and a gather of sizes
// plus a gatherv of that rank's document text to rank 0, which diffs the two documents and
// names the first differing key (in key order). Every rank then throws AgreedFailure with exit
// code 2; rank 0 reports:
//   ranks disagree on the configuration: model.n_layer is 2 on rank 0 but 3 on rank 1
#pragma once

#include <mpi.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "config/config.hpp"

namespace zero3d {

// The document the ranks must agree on (see above). Never throws for an unreadable init_from
// file: its digest reads "unreadable (<reason>)" and the engine reports the error later.
nlohmann::json agreement_document(const Config& cfg);

// Digest of a file's bytes as 16 hex digits, or "unreadable (<reason>)".
std::string file_digest(const std::string& path);

// The first key (dotted path, in sorted key order) at which a and b differ, with both values
// as short JSON text ("absent" where a key is missing on one side); false if a == b.
bool first_difference(const nlohmann::json& a, const nlohmann::json& b, std::string& key, std::string& value_a,
                      std::string& value_b);

// Collective over comm. Returns if every rank's agreement document is the same; otherwise
// throws AgreedFailure (exit 2) on every rank, with the message on rank 0. Also exchanges the
// ranks' pids and hosts for failure messages (failure.hpp: exchange_rank_identities, one
// MPI_Allgather).
void agree_on_configuration(MPI_Comm comm, const Config& cfg);

}  // namespace zero3d
