#pragma once
// The members of a new torch subgroup (new_group) agree on who they are before they make its
// MPI communicator. MPI_Comm_create_group waits without end for a member that never calls it,
// and ranks given different lists may each wait for members that are making another group.

#include <string>
#include <vector>

namespace gradcomm::torch_backend {

// Every member sends torch's name of the group (`group_name`, the same on every rank for one
// new_group call) and its list of world ranks (`members`, in group order) to every other member
// and receives theirs, on MPI_COMM_WORLD. A message under another name is another call's (one
// left by an earlier new_group that failed, or from a rank out of step) and is set aside.
// Throws MismatchError naming both lists where a member was given another list, and CommError
// naming the members that sent nothing under this name where `timeout_seconds` (> 0; 0: no
// limit) pass first (`timeout_text` says where that limit comes from). Returns once every member
// has the same list: MPI_Comm_create_group then returns.
void agree_on_members(const std::string& call, const std::vector<int>& members,
                      const std::string& group_name, int world_rank, int world_size,
                      int timeout_seconds, const std::string& timeout_text);

}  // namespace gradcomm::torch_backend
