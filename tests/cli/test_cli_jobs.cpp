// test_cli_jobs.cpp — batch jobs that survive the cluster (issue 19): the scheduler's warning
// signal saves and asks for a requeue, `resume: "auto"` continues bit for bit, a resumed run
// keeps its data position and its metrics history straight, and launch mistakes stop before
// any training.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/background_job.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// A model large enough that a step takes a few milliseconds at np 2 (a signal lands mid-run),
// small enough that 40 steps stay under a few seconds.
json job_config(int64_t steps) {
  json j = tiny_config();
  j["model"] = {{"vocab_size", 64}, {"n_positions", 32}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}};
  j["training"]["steps"] = steps;
  j["training"]["resume"] = "auto";
  return j;
}

std::vector<int64_t> steps_of(const std::vector<json>& rows) {
  std::vector<int64_t> out;
  for (const json& r : rows) out.push_back(r.at("step").get<int64_t>());
  return out;
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Whether a save is in progress in `save_dir`: a `<tag>.tmp` directory exists.
bool saving(const std::string& save_dir) {
  DIR* d = opendir(save_dir.c_str());
  if (!d) return false;
  bool found = false;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    found = found || (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0);
  }
  closedir(d);
  return found;
}

// Whether process `pid` is stopped (state T in /proc/PID/stat).
bool stopped(int pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t p = stat.rfind(')');
  return p != std::string::npos && p + 2 < stat.size() && stat[p + 2] == 'T';
}

// Sends SIGCONT to a process when the scope ends, however it ends.
struct ContinuedOnExit {
  int pid;
  explicit ContinuedOnExit(int p) : pid(p) {}
  ~ContinuedOnExit() { kill(pid, SIGCONT); }
};

struct Layout {
  const char* name;
  const char* sets;  // --set overrides
};

class Preemption : public ::testing::TestWithParam<Layout> {};

// The scheduler's SIGTERM at a random step: every rank finishes the step, a complete checkpoint
// at that step is saved, the job exits 75 (requeue); the requeued job (resume "auto") trains to
// the end, and the whole history equals an uninterrupted run bit for bit, each step once.
TEST_P(Preemption, SigtermSavesTheStepReachedAndTheRequeuedJobContinuesBitForBit) {
  const Layout layout = GetParam();
  const int64_t steps = 40;
  const std::string name = std::string("preempt_") + layout.name;
  const std::string sets = std::string(" --set ") + layout.sets;
  const std::string ref_dir = temp_path(name + "_ref");
  const Result ref = run("train " + write_config(name + "_ref.json", job_config(steps)) + " --output " + ref_dir + sets, 2);
  ASSERT_EQ(ref.code, 0) << ref.err;
  const std::vector<double> want = losses_of(read_metrics(ref_dir));
  ASSERT_EQ(want.size(), size_t(steps));

  std::mt19937 rng(std::random_device{}());
  const size_t at = 2 + rng() % 10;  // the signal arrives once step `at` is done
  // Rank 1 stops itself as step at+1 begins (ZERO3D_FAULT pause), so even a build that trains
  // these 40 steps faster than this test can look has not passed it; there it gets SIGTERM and
  // goes on. Slurm may signal one task before the other: rank 0 hears of it from rank 1.
  BackgroundJob first(name, job_config(steps), "ZERO3D_FAULT=pause:1:" + std::to_string(at + 1), 2, sets);
  int r1 = -1;  // looked up again until stopped: at first only zero3d's supervisor may be there
  for (const auto end = Clock::now() + std::chrono::seconds(60); Clock::now() < end && !(r1 > 0 && stopped(r1));) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    r1 = first.rank_pid(1);
  }
  ASSERT_GT(r1, 0) << read_file(first.err_file);
  const ContinuedOnExit continued(r1);  // a failed check below must not leave the job frozen
  ASSERT_TRUE(stopped(r1)) << read_file(first.err_file);
  ASSERT_EQ(kill(r1, SIGTERM), 0);
  ASSERT_EQ(kill(r1, SIGCONT), 0);
  ASSERT_EQ(first.wait(60), 75) << read_file(first.err_file) << read_file(first.out_file);
  const std::vector<json> before = read_metrics(first.dir);
  EXPECT_EQ(before.size(), at + 1) << "the step the signal arrived in is finished and saved";
  ASSERT_LT(before.size(), size_t(steps)) << "the run ended before the signal arrived";
  const std::string tag = "global_step" + std::to_string(before.size());
  const std::string out = read_file(first.out_file);
  EXPECT_NE(out.find("preempted: SIGTERM received; saved " + first.dir + "/checkpoints/" + tag + " at step " +
                     std::to_string(before.size()) + " of 40; exit 75"),
            std::string::npos)
      << out;
  EXPECT_EQ(read_file(first.dir + "/checkpoints/latest"), tag + "\n");
  EXPECT_EQ(run("inspect " + first.dir + "/checkpoints").code, 0);  // complete and verified
  // The same line in <output>/requeue, for job scripts whose launcher reports 0 instead of 75.
  EXPECT_EQ(read_file(first.dir + "/requeue").rfind("preempted: SIGTERM received; saved ", 0), 0u);

  BackgroundJob requeued(name, job_config(steps), "", 2, sets, /*keep_dir=*/true);
  ASSERT_EQ(requeued.wait(60), 0) << read_file(requeued.err_file);
  EXPECT_FALSE(std::ifstream(requeued.dir + "/requeue").good()) << "the requeued run removes the last note";
  const std::vector<json> rows = read_metrics(requeued.dir);
  std::vector<int64_t> expect_steps(steps);
  for (int64_t i = 0; i < steps; ++i) expect_steps[i] = i + 1;
  EXPECT_EQ(steps_of(rows), expect_steps);
  const std::vector<double> got = losses_of(rows);
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Preemption,
                         ::testing::Values(Layout{"zero1", "zero_optimization.stage=1"},
                                           Layout{"zero3", "zero_optimization.stage=3"},
                                           Layout{"pipeline", "pipeline.stages=2 --set gradient_accumulation_steps=2"}),
                         [](const auto& info) { return std::string(info.param.name); });

// SIGUSR1 (sbatch --signal=USR1@120), then a second signal while the checkpoint is being
// written: one save, complete, and the job still asks to be requeued.
TEST(Preemption, ASecondSignalDuringTheSaveChangesNothing) {
  json j = job_config(400);
  j["training"]["save_interval"] = 1;  // a save at every step: the second signal lands in one
  BackgroundJob job("preempt_usr1", j);
  ASSERT_TRUE(job.wait_for_rows(3, 60)) << read_file(job.err_file);
  const int r0 = job.rank_pid(0), r1 = job.rank_pid(1);
  ASSERT_GT(r0, 0);
  ASSERT_GT(r1, 0);
  // both signals while a save is under way (its `<tag>.tmp` directory exists; a save takes
  // about 100 ms here)
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (!saving(job.dir + "/checkpoints") && Clock::now() < end) std::this_thread::yield();
  kill(r0, SIGUSR1);
  kill(r1, SIGUSR1);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  kill(r0, SIGTERM);
  kill(r1, SIGUSR1);
  ASSERT_EQ(job.wait(60), 75) << read_file(job.err_file);
  const std::string out = read_file(job.out_file);
  EXPECT_EQ(count(out, "preempted: SIGUSR1 received"), 1u) << out;
  const size_t steps = job.metrics_rows();
  EXPECT_EQ(read_file(job.dir + "/checkpoints/latest"), "global_step" + std::to_string(steps) + "\n");
  const Result inspect = run("inspect " + job.dir + "/checkpoints");
  EXPECT_EQ(inspect.code, 0) << inspect.err;
}

TEST(AutoResume, StartsFreshWhenThereIsNoCheckpointAndSaysSo) {
  const std::string dir = temp_path("auto_fresh");
  const Result r = run("train " + write_config("auto_fresh.json", job_config(3)) + " --output " + dir, 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("resume  auto: no checkpoint in " + dir + "/checkpoints yet; starting fresh"), std::string::npos)
      << r.out;
  EXPECT_EQ(read_metrics(dir).size(), 3u);
}

// A checkpoint at or past training.steps: nothing to train, exit 0, the history untouched.
TEST(AutoResume, ACheckpointAtTheLastStepHasNothingToDo) {
  json j = job_config(6);
  j["training"]["save_interval"] = 3;
  const std::string cfg = write_config("done.json", j), dir = temp_path("done");
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const std::string history = read_file(dir + "/metrics.jsonl");
  for (const char* steps : {"6", "4"}) {
    const Result again = run("train " + cfg + " --output " + dir + " --set training.steps=" + steps, 1);
    EXPECT_EQ(again.code, 0) << again.err;
    EXPECT_NE(again.out.find("nothing to do: the checkpoint is at step 6 and training.steps is " + std::string(steps)),
              std::string::npos)
        << again.out;
    EXPECT_EQ(read_file(dir + "/metrics.jsonl"), history);
  }
}

// Killed after its last save, a run is resumed from that save: the steps it took after the save
// are dropped from metrics.jsonl, so every step appears once.
TEST(ResumeHygiene, MetricsPastTheResumedStepAreDropped) {
  json j = job_config(8);
  j["training"]["save_interval"] = 5;
  j["training"].erase("resume");
  const std::string cfg = write_config("truncate.json", j), dir = temp_path("truncate");
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const std::vector<double> first = losses_of(read_metrics(dir));
  const Result r = run("train " + cfg + " --output " + dir + " --set training.resume=global_step5", 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("dropped 3 records past step 5"), std::string::npos) << r.out;
  const std::vector<json> rows = read_metrics(dir);
  EXPECT_EQ(steps_of(rows), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(losses_of(rows), first);  // and the resumed steps repeat the same losses
}

// The global batch changed across a resume: the data continues at the saved sample count
// (step x the old batch), not at step x the new batch.
TEST(ResumeHygiene, DataContinuesAtTheSavedSampleCountWhenTheBatchChanges) {
  json j = job_config(4);
  j["training"]["save_interval"] = 4;
  j["training"].erase("resume");
  const std::string cfg = write_config("batch_change.json", j), dir = temp_path("batch_change");
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 2).code, 0);  // 4 steps x 8 samples
  const Result r = run("train " + cfg + " --output " + dir +
                           " --set training.resume=latest --set training.steps=6 --set train_batch_size=4",
                       1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("the data continues at sample 32, where that run stopped"), std::string::npos) << r.out;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[4].at("samples"), 36);  // 32 + 4
  EXPECT_EQ(rows[5].at("samples"), 40);
}

// One step left after a resume: the step line and the summary show finite figures.
TEST(ResumeHygiene, OneStepLeftReportsFiniteThroughput) {
  json j = job_config(3);
  j["training"]["save_interval"] = 3;
  const std::string cfg = write_config("one_left.json", j), dir = temp_path("one_left");
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const Result r = run("train " + cfg + " --output " + dir + " --set training.steps=4", 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("inf"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("done: 1 steps"), std::string::npos) << r.out;
  EXPECT_GT(read_metrics(dir).back().at("tokens_per_s").get<double>(), 0.0);
}

// ---- launch safety: each case exits 2 before any training ----------------------------------

TEST(LaunchSafety, SchedulerTasksThatMpiSeesAsOneRankAreRefused) {
  for (int rank : {0, 1}) {  // what `srun` without PMI starts: N independent one-rank jobs
    const std::string dir = temp_path("no_pmi");
    const Result r = run("train " + write_config("no_pmi.json", job_config(3)) + " --output " + dir, 0,
                         "SLURM_NTASKS=2 SLURM_PROCID=" + std::to_string(rank));
    expect_one_line_rejection(r, "SLURM_NTASKS=2 says this job has 2 tasks, but MPI reports 1 rank");
    EXPECT_FALSE(is_file(dir + "/metrics.jsonl"));
  }
  // the launcher's own count wins: `mpiexec -np 1` inside a 2-task allocation is one rank on purpose
  const Result ok = run("train " + write_config("no_pmi.json", job_config(2)) + " --output " + temp_path("pmi_ok"), 1,
                        "SLURM_NTASKS=2");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST(LaunchSafety, ASecondJobIntoARunningJobsOutputDirectoryIsRefusedNamingIt) {
  BackgroundJob running("locked", job_config(100000));
  ASSERT_TRUE(running.wait_for_rows(1, 60)) << read_file(running.err_file);
  const Result second = run("train " + write_config("locked2.json", job_config(3)) + " --output " + running.dir, 1);
  expect_one_line_rejection(second, "output directory " + running.dir + " is in use by a running zero3d job (pid ");
  EXPECT_NE(second.err.find(" on host "), std::string::npos) << second.err;
  kill(running.rank_pid(0), SIGKILL);
  kill(running.rank_pid(1), SIGKILL);
  running.wait(30);
}

TEST(LaunchSafety, AnUnwritableSaveDirIsFoundAtStartUp) {
  const std::string blocker = temp_path("not_a_dir");
  std::ofstream(blocker) << "a file where a directory should go\n";
  json j = job_config(30);
  j["training"]["save_interval"] = 25;
  j["training"]["save_dir"] = blocker + "/ck";
  const std::string cfg = write_config("unwritable.json", j), dir = temp_path("unwritable");
  const Result train = run("train " + cfg + " --output " + dir, 2);
  expect_one_line_rejection(train, "training.save_dir " + blocker + "/ck: " + blocker +
                                       " is not a directory, so it cannot be created");
  EXPECT_FALSE(is_file(dir + "/metrics.jsonl"));
  expect_one_line_rejection(run("validate " + cfg), "training.save_dir " + blocker + "/ck");
}

// ---- validate checks what train would open --------------------------------------------------

TEST(Validate, NamesEveryFileTrainWouldFailToOpen) {
  const std::string missing = temp_path("no_such_file");
  json data = job_config(3);
  data["model"]["vocab_size"] = 256;  // byte-level text
  data["data"] = {{"source", "text"}, {"path", missing}};
  expect_one_line_rejection(run("validate " + write_config("v_data.json", data)), missing);
  json shards = job_config(3);
  shards["data"] = {{"source", "tokens"}, {"path", missing + "_*.bin"}};
  expect_one_line_rejection(run("validate " + write_config("v_shards.json", shards)), "no token shard matches");
  json init = job_config(3);
  init["model"]["init_from"] = missing + ".safetensors";
  expect_one_line_rejection(run("validate " + write_config("v_init.json", init)), missing + ".safetensors");
  json resume = job_config(3);
  resume["training"]["resume"] = missing;
  expect_one_line_rejection(run("validate " + write_config("v_resume.json", resume)), missing);
}

// ---- small defects ---------------------------------------------------------------------------

TEST(Topology, UnderMpiexecCountsTheJobsRanks) {
  const Result r = run("topology", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("2 ranks = pipe 1 x data 2 x model 1", 0), 0u) << r.out;
}

TEST(Help, SubcommandHelpStartsWithZero3dNotKokkos) {
  const Result r = run("train --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out.find("Kokkos"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.rfind("Train a model", 0), 0u) << r.out;
}

// AdamW and Adam with adam_w_mode false keep the same states but update differently: resuming
// under the other rule is refused; DeepSpeed's "Adam" (adam_w_mode defaults to true) is AdamW.
TEST(Optimizer, ACheckpointResumesOnlyUnderItsUpdateRule) {
  json j = job_config(2);
  j["training"]["save_interval"] = 2;
  j["optimizer"]["params"]["weight_decay"] = 0.1;
  const std::string cfg = write_config("adamw.json", j), dir = temp_path("adamw");
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const Result inspect = run("inspect " + dir + "/checkpoints");
  EXPECT_NE(inspect.out.find("optimizer AdamW"), std::string::npos) << inspect.out;
  expect_one_line_rejection(
      run("train " + cfg + " --output " + dir + " --set training.steps=3 --set optimizer.type=Adam --set optimizer.params.adam_w_mode=false", 1),
      "saved with the AdamW update rule (decoupled weight decay, adam_w_mode true), the config gives Adam");
  const Result adam = run("train " + cfg + " --output " + dir + " --set training.steps=3 --set optimizer.type=Adam", 1);
  EXPECT_EQ(adam.code, 0) << adam.err;
}

}  // namespace

// ---- the job scripts (jobs/), against stand-ins for the scheduler's commands -----------------

// A directory of fake mpiexec/srun/scontrol/qrerun that log their arguments to LOG and exit
// with $FAKE_RC (the launchers) or 0; runs `script` with it first on PATH. Returns the log.
std::string run_job_script(const std::string& name, const std::string& script, const std::string& env, int* rc) {
  const std::string bin = temp_path(name + "_bin"), log = temp_path(name + ".log");
  std::system(("mkdir -p " + bin + " && rm -f " + log).c_str());
  for (const char* tool : {"mpiexec", "srun", "scontrol", "qrerun"}) {
    const bool launcher = std::string(tool) == "mpiexec" || std::string(tool) == "srun";
    // FAKE_REQUEUE: leave zero3d's preemption note in $OUTPUT, as a preempted run does.
    std::ofstream(bin + "/" + tool) << "#!/bin/sh\necho \"" << tool << " $*\" >> " << log << "\n"
                                    << (launcher ? "[ -n \"$FAKE_REQUEUE\" ] && mkdir -p \"$OUTPUT\" && "
                                                   "echo preempted > \"$OUTPUT/requeue\"\nexit ${FAKE_RC:-0}\n"
                                                 : "exit 0\n");
    std::system(("chmod +x " + bin + "/" + tool).c_str());
  }
  const int status = std::system(("cd " + kSource + " && env -u PBS_NODEFILE -u NP -u PBS_JOBID -u SLURM_JOB_ID " + env +
                                  " PATH=" + bin + ":$PATH bash " + script + " >/dev/null 2>&1")
                                     .c_str());
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return read_file(log);
}

TEST(JobScripts, PbsOutsidePbsRunsOneRankNotZero) {
  int rc = 0;
  const std::string log = run_job_script("pbs_local", "jobs/pbs.sh", "", &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(log.rfind("mpiexec -np 1 build/zero3d train input/quickstart.json --output output/zero3d "
                      "--set training.resume=auto",
                      0),
            0u)
      << log;
}

TEST(JobScripts, PreemptedJobsAreRequeuedAndResumeAutomatically) {
  int rc = 0;
  std::string log = run_job_script("slurm_requeue", "jobs/slurm.sbatch", "FAKE_RC=75 SLURM_JOB_ID=42 SLURM_JOB_NAME=gpt", &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_NE(log.find("srun build/zero3d train input/quickstart.json --output output/gpt --set training.resume=auto"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("scontrol requeue 42"), std::string::npos) << log;
  log = run_job_script("slurm_fail", "jobs/slurm.sbatch", "FAKE_RC=2 SLURM_JOB_ID=42", &rc);
  EXPECT_EQ(rc, 2);  // bad input is not requeued
  EXPECT_EQ(log.find("scontrol"), std::string::npos) << log;
  log = run_job_script("pbs_rerun", "jobs/pbs.sh", "FAKE_RC=75 PBS_JOBID=7.server", &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_NE(log.find("qrerun 7.server"), std::string::npos) << log;
  // A launcher signalled together with its ranks may exit 0: the note in <output> still requeues,
  // and a run that finished (no note) is not requeued.
  const std::string out = temp_path("requeue_note");
  for (const char* script : {"jobs/slurm.sbatch", "jobs/pbs.sh"}) {
    log = run_job_script("rc0_note", script, "FAKE_RC=0 FAKE_REQUEUE=1 SLURM_JOB_ID=43 PBS_JOBID=43 OUTPUT=" + out, &rc);
    EXPECT_EQ(rc, 0) << script;
    EXPECT_TRUE(log.find("scontrol requeue 43") != std::string::npos || log.find("qrerun 43") != std::string::npos)
        << script << ": " << log;
    log = run_job_script("rc0_done", script, "FAKE_RC=0 SLURM_JOB_ID=44 PBS_JOBID=44 OUTPUT=" + out, &rc);
    EXPECT_EQ(rc, 0) << script;
    EXPECT_TRUE(log.find("scontrol") == std::string::npos && log.find("qrerun") == std::string::npos)
        << script << ": a finished run was requeued: " << log;
  }
}

// The scheduler signals the job script's own shell too: it must live to requeue.
TEST(JobScripts, TheScriptSurvivesTheSchedulersSignalToRequeue) {
  int rc = 0;
  // A launcher that signals the script (its parent) the way PBS signals the session, then exits 75.
  const std::string bin = temp_path("sig_bin"), log = temp_path("sig.log");
  std::system(("mkdir -p " + bin + " && rm -f " + log).c_str());
  for (const char* tool : {"mpiexec", "srun"}) {
    std::ofstream(bin + "/" + tool) << "#!/bin/sh\nkill -TERM $PPID\nsleep 1\nexit 75\n";
    std::system(("chmod +x " + bin + "/" + tool).c_str());
  }
  for (const char* tool : {"scontrol", "qrerun"}) {
    std::ofstream(bin + "/" + tool) << "#!/bin/sh\necho \"" << tool << " $*\" >> " << log << "\nexit 0\n";
    std::system(("chmod +x " + bin + "/" + tool).c_str());
  }
  for (const char* script : {"jobs/slurm.sbatch", "jobs/pbs.sh"}) {
    std::system(("rm -f " + log).c_str());
    const int status = std::system(("cd " + kSource + " && env SLURM_JOB_ID=45 PBS_JOBID=45 OUTPUT=" +
                                    temp_path("sig_out") + " PATH=" + bin + ":$PATH bash " + script + " >/dev/null 2>&1")
                                       .c_str());
    rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    EXPECT_EQ(rc, 0) << script << " died of the signal instead of requeueing";
    EXPECT_NE(read_file(log), "") << script;
  }
}
