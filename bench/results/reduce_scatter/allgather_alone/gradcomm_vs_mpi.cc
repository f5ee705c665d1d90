#include <mpi.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include "collectives/exchange.h"
#include "gradcomm/gradcomm.h"
int main(int argc,char**argv){MPI_Init(&argc,&argv);int me,n;MPI_Comm_rank(MPI_COMM_WORLD,&me);MPI_Comm_size(MPI_COMM_WORLD,&n);
{ gradcomm::Communicator comm(MPI_COMM_WORLD);
for(size_t bytes: {8u, 1024u, 65536u, 1u<<20, 4u<<20}){
 size_t count=bytes/4/n; std::vector<float> send(count,1.f), recv(count*n);
 std::vector<double> t[2];
 for(int r=0;r<21;r++) for(int v0=0;v0<2;v0++){int v=(v0+r)%2;
  MPI_Barrier(MPI_COMM_WORLD); double s=MPI_Wtime();
  for(int c=0;c<(bytes<(1u<<20)?50:3);c++){
   if(v) gradcomm::allgather_bytes(comm, send.data(), recv.data(), count*4);
   else MPI_Allgather(send.data(),count,MPI_FLOAT,recv.data(),count,MPI_FLOAT,MPI_COMM_WORLD);}
  double e=(MPI_Wtime()-s)/(bytes<(1u<<20)?50:3); double m; MPI_Allreduce(&e,&m,1,MPI_DOUBLE,MPI_MAX,MPI_COMM_WORLD); t[v].push_back(m*1e6);}
 if(me==0){printf("%9zu",bytes); for(auto&x:t){std::sort(x.begin(),x.end());printf(" %9.1f",x[x.size()/2]);} printf("   (mpi gradcomm)\n");}
}}
MPI_Finalize();}
